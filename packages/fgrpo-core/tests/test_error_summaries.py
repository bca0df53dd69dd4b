"""An error line quotes the first line of the exception behind it: one helper, and an exception
whose message is empty is reported by its type (it used to raise IndexError and hide the error)."""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import save_file

from fgrpo.core import checkpoint as ckpt
from fgrpo.core import yaml_reading
from fgrpo.core.config import RecipeError, first_line


def test_first_line_is_the_first_non_blank_line_cut_short():
    assert first_line(ValueError("bad value\nTraceback and more")) == "bad value"
    assert first_line(ValueError("\n  \n  indented\nnext")) == "indented"
    assert first_line(ValueError("x" * 500), limit=120) == "x" * 120
    assert first_line(KeyError()) == "KeyError"
    assert first_line(RuntimeError("")) == "RuntimeError"


def test_a_tensor_file_that_fails_with_an_empty_message_is_a_checkpoint_error(tmp_path, monkeypatch):
    path = tmp_path / ckpt.TRAINABLE
    save_file({"w": torch.zeros(2)}, str(path))

    def broken(*args, **kwargs):
        raise RuntimeError()

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "load_file", broken)  # what the reader calls, after its checks
    with pytest.raises(ckpt.CheckpointError, match=r"trainable.safetensors does not read back \(RuntimeError\)"):
        ckpt.read_tensors(path)


def test_a_torch_file_that_fails_with_an_empty_message_is_a_checkpoint_error(tmp_path, monkeypatch):
    path = tmp_path / "optimizer.pt"
    torch.save({"step": 1}, path)

    def broken(*args, **kwargs):
        raise RuntimeError("")

    monkeypatch.setattr(torch, "load", broken)
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer.pt does not read back \(RuntimeError\)"):
        ckpt.read_torch(path)


def test_a_yaml_error_without_a_message_is_a_recipe_error(monkeypatch):
    def broken(self):
        raise yaml.YAMLError()

    monkeypatch.setattr(yaml.SafeLoader, "get_single_node", broken)
    with pytest.raises(RecipeError) as info:
        yaml_reading.load_yaml("seed: 0", "recipe.yaml")
    assert str(info.value.errors[0]) == "recipe.yaml: malformed YAML: YAMLError"
