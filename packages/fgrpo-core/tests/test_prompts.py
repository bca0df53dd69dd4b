"""Prompt sources with metadata: text files, and dataset folders in flow_grpo's layout."""

from __future__ import annotations

import json

import pytest

from fgrpo.core import registry
from fgrpo.core.config import RecipeError
from fgrpo.core.protocols import PromptSource

GENEVAL_ROWS = [
    {
        "tag": "counting",
        "include": [{"class": "chair", "count": 4}],
        "exclude": [{"class": "chair", "count": 5}],
        "prompt": "a photo of four chairs",
    },
    {
        "tag": "position",
        "include": [{"class": "cup", "count": 1}, {"class": "couch", "count": 1, "position": ["below", 0]}],
        "prompt": "a photo of a couch below a cup",
    },
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_geneval_folder_passes_tag_include_exclude_as_metadata(tmp_path):
    write_jsonl(tmp_path / "train_metadata.jsonl", GENEVAL_ROWS)
    write_jsonl(tmp_path / "test_metadata.jsonl", GENEVAL_ROWS[1:])
    source = registry.create("prompts", "folder", path=str(tmp_path))
    assert isinstance(source, PromptSource)
    assert source.train_prompts() == ["a photo of four chairs", "a photo of a couch below a cup"]
    assert source.test_prompts() == ["a photo of a couch below a cup"]
    meta = source.metadata("a photo of four chairs")
    assert meta == {k: v for k, v in GENEVAL_ROWS[0].items() if k != "prompt"}
    assert source.metadata("never seen") == {}


def test_text_folder_as_flow_grpo_ocr(tmp_path):
    (tmp_path / "train.txt").write_text('a sign "OPEN"\n\na mug that says "hi"\n')
    (tmp_path / "test.txt").write_text('a poster "GRPO"\n')
    source = registry.create("prompts", "folder", path=str(tmp_path))
    assert source.train_prompts() == ['a sign "OPEN"', 'a mug that says "hi"']
    assert source.test_prompts() == ['a poster "GRPO"'] and source.metadata('a poster "GRPO"') == {}


def test_metadata_file_wins_and_test_may_be_off(tmp_path):
    (tmp_path / "train.txt").write_text("plain\n")
    write_jsonl(tmp_path / "train_metadata.jsonl", [{"prompt": "rich", "text": "X"}])
    source = registry.create("prompts", "folder", path=str(tmp_path), test=None)
    assert source.train_prompts() == ["rich"] and source.metadata("rich") == {"text": "X"}
    assert source.test_prompts() == []


def test_folder_errors_are_reported_at_validation(tmp_path):
    with pytest.raises(RecipeError, match=r"prompts.path: got .*expected an existing folder"):
        registry.create("prompts", "folder", path=str(tmp_path / "nope"))
    (tmp_path / "train.txt").write_text("a\n")
    with pytest.raises(RecipeError) as info:
        registry.create("prompts", "folder", path=str(tmp_path), train="dev")
    messages = [str(e) for e in info.value.errors]
    assert any(
        m.startswith("prompts.train: got 'dev'") and "dev_metadata.jsonl or dev.jsonl or dev.txt" in m
        for m in messages
    )
    assert any(m.startswith("prompts.test: got 'test'") for m in messages)


def test_same_prompt_with_two_metadata_is_an_error(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "p", "tag": "a"}, {"prompt": "p", "tag": "b"}])
    with pytest.raises(
        RecipeError, match="prompts.path: .*appears twice with different metadata"
    ):  # found by `validate` too
        registry.create("prompts", "folder", path=str(tmp_path), test=None)
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "p", "tag": "a"}, {"prompt": "p", "tag": "a"}])
    assert registry.create("prompts", "folder", path=str(tmp_path), test=None).train_prompts() == ["p", "p"]


def test_text_file_jsonl_metadata(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", GENEVAL_ROWS)
    source = registry.create("prompts", "text-file", train=str(tmp_path / "train.jsonl"))
    assert source.metadata("a photo of a couch below a cup")["tag"] == "position"
