"""``fgrpo push``: what it would send to the Hugging Face Hub (repository, files, private flag, model
card), checked without the network by recording ``HfApi``'s calls; and its refusals, one line and
exit 2, without a token, with the hub unreachable, or silent past its deadline."""

from __future__ import annotations

import socket
import time

import pytest

from _helpers import TINY_SHAPES, free_port
from fgrpo.core import cli, push

TINY = [*TINY_SHAPES, "eval.every=1", "eval.steps=2", "eval.samples_per_prompt=1", "eval.max_prompts=4"]
EXPORT = ["adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture(scope="module")
def run(root, tmp_path_factory):
    folder = tmp_path_factory.mktemp("push") / "run"
    sets = [arg for item in TINY for arg in ("--set", item)]
    assert cli.main(["compose", str(root / "recipes" / "shapes.yaml"), "--out", str(folder), "--quiet", *sets]) == 0
    return folder


@pytest.fixture
def online(monkeypatch):
    """The tests' HF_HUB_OFFLINE=1 (conftest.py) lifted: push refuses to start under it."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read once, when huggingface_hub is imported


@pytest.fixture
def hub(monkeypatch, online):
    """``HfApi``'s calls recorded instead of sent: each (method, args, kwargs), and the files of the
    uploaded folder with their contents (the staging folder is gone once the command returns)."""
    from huggingface_hub import HfApi

    calls: list[tuple[str, tuple, dict]] = []
    uploaded: dict[str, bytes] = {}

    def whoami(self, *args, **kwargs):
        calls.append(("whoami", args, kwargs))
        return {"name": "someone"}

    def create_repo(self, *args, **kwargs):
        calls.append(("create_repo", args, kwargs))

    def upload_folder(self, *args, **kwargs):
        from pathlib import Path

        calls.append(("upload_folder", args, kwargs))
        root = Path(kwargs["folder_path"])
        uploaded.update({p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()})

    for fn in (whoami, create_repo, upload_folder):
        monkeypatch.setattr(HfApi, fn.__name__, fn)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    return calls, uploaded


def test_push_uploads_the_export_and_a_model_card(run, hub, capsys):
    calls, uploaded = hub
    assert cli.main(["push", str(run), "someone/shapes-lora", "--private"]) == 0
    assert [c[0] for c in calls] == ["whoami", "create_repo", "upload_folder"]
    _, args, kwargs = calls[1]
    assert args == ("someone/shapes-lora",) and kwargs["private"] is True and kwargs["exist_ok"] is True
    assert calls[2][2]["repo_id"] == "someone/shapes-lora" and calls[2][2]["repo_type"] == "model"
    assert sorted(uploaded) == ["README.md", *EXPORT]
    last = (run / "checkpoints" / "last").resolve()
    assert uploaded["adapter_model.safetensors"] == (last / "export" / "adapter_model.safetensors").read_bytes()
    card = uploaded["README.md"].decode()
    assert "library_name: peft" in card and "shapes-dit" in card and "iteration 1" in card
    assert "| gold/shapes-gold/gold_error |" in card  # the run's last evaluation
    assert "pushed 3 files" in capsys.readouterr().out


def test_push_takes_an_export_folder_and_dry_run_sends_nothing(run, hub, tmp_path, capsys, monkeypatch):
    calls, uploaded = hub
    exported = tmp_path / "exported"
    assert cli.main(["export", str(run), "--out", str(exported)]) == 0
    monkeypatch.delenv("HF_TOKEN")  # a dry run needs neither a token nor the network
    assert cli.main(["push", str(exported), "someone/x", "--dry-run"]) == 0
    shown = capsys.readouterr().out
    assert "would upload 3 files" in shown and "public model repository" in shown
    assert all(name in shown for name in ["README.md", *EXPORT])
    assert calls == []
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert cli.main(["push", str(exported), "someone/x"]) == 0
    assert sorted(uploaded) == ["README.md", *EXPORT] and calls[1][2]["private"] is False


def test_push_refuses_without_a_token(run, hub, monkeypatch, tmp_path, capsys):
    import huggingface_hub

    calls, _ = hub
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no stored login either
    assert cli.main(["push", str(run), "someone/x"]) == 2
    error = capsys.readouterr().err
    assert "no Hugging Face token: set HF_TOKEN or log in with `hf auth login`" in error
    assert calls == []
    assert cli.main(["push", str(run), "not a repo id!"]) == 2
    assert "is not a hub repository id" in capsys.readouterr().err


def test_push_refuses_in_offline_mode(run, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["push", str(run), "someone/x"]) == 2
    assert "HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE) forbids contacting the hub" in capsys.readouterr().err


def test_push_refuses_an_unreachable_or_silent_hub_within_its_deadline(run, online, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert cli.main(["push", str(run), "someone/x"]) == 2
    assert "error: push: checking the token:" in capsys.readouterr().err

    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(push, "PROBE_TIMEOUT_S", 1.0)
        start = time.monotonic()
        assert cli.main(["push", str(run), "someone/x"]) == 2
        assert time.monotonic() - start < 20
    finally:
        silent.close()
    assert "checking the token: the hub gave no answer within 1 s" in capsys.readouterr().err
