"""Prompts that carry source images (editing, image-to-video): the Prompt type, flow_grpo's editing
dataset layout, bad images refused at validation, the model/prompt mismatch refused, rewards that
receive the sources, and source -> output tiles."""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image

from fgrpo.core import media, registry, scoring
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.config import RecipeError
from fgrpo.core.media import Prompt
from fgrpo.core.prompts import read_prompt_file
from fgrpo.core.protocols import RewardResult

ROWS = [  # flow_grpo's dataset/counting_edit/train_metadata.jsonl, first rows (two share an instruction)
    {
        "tag": "counting",
        "include": [{"class": "airplane", "count": 2}],
        "exclude": [{"class": "airplane", "count": 3}],
        "t2i_prompt": "a photo of one airplanes",
        "prompt": "Change the number of airplane in the image to two.",
        "image": "generated_images/image_66.jpg",
    },
    {
        "tag": "counting",
        "include": [{"class": "airplane", "count": 2}],
        "exclude": [{"class": "airplane", "count": 3}],
        "t2i_prompt": "a photo of four airplanes",
        "prompt": "Change the number of airplane in the image to two.",
        "image": "generated_images/image_12.jpg",
    },
    {
        "tag": "counting",
        "include": [{"class": "banana", "count": 4}],
        "exclude": [{"class": "banana", "count": 5}],
        "t2i_prompt": "a photo of three bananas",
        "prompt": "Change the number of banana in the image to four.",
        "image": "generated_images/image_169.jpg",
    },
]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def editing_folder(root: Path, rows: list[dict] = ROWS, size: tuple[int, int] = (20, 12)) -> Path:
    for i, row in enumerate(rows):
        target = root / row["image"]
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (40 * i, 100, 200)).save(target)
    write_jsonl(root / "train_metadata.jsonl", rows)
    write_jsonl(root / "test_metadata.jsonl", rows[2:])
    return root


def png_header(path: Path, width: int, height: int) -> None:
    """A PNG whose header claims width x height and holds no pixel data (a decompression bomb's shape)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))


# --- the Prompt type ------------------------------------------------------------------------------


def test_prompt_identity_is_text_and_images():
    a, b = Prompt("edit", images=("/a.png",)), Prompt("edit", images=("/b.png",))
    assert a != b and a != "edit" and len({a, b, "edit"}) == 3
    assert Prompt("edit") == "edit" and hash(Prompt("edit")) == hash("edit")  # no images: the text itself
    assert a == Prompt("edit", images=("/a.png",), origin="elsewhere:3")  # origin is not identity
    assert a.text == "edit" and type(a.text) is str and media.text_of(a) == "edit"
    copy = pickle.loads(pickle.dumps(a))
    assert copy == a and copy.images == ("/a.png",) and isinstance(copy, Prompt)
    assert json.dumps([a]) == '["edit"]' and a.upper() == "EDIT"


# --- flow_grpo's editing layout -----------------------------------------------------------------------


def test_folder_reads_flow_grpo_editing_layout(tmp_path):
    root = editing_folder(tmp_path)
    source = registry.create("prompts", "folder", path=str(root))
    train = source.train_prompts()
    assert [p.text for p in train] == [r["prompt"] for r in ROWS]
    assert train[0] != train[1] and len(set(train)) == 3  # same instruction, different sources: two prompts
    assert train[0].images == (str((root / ROWS[0]["image"]).resolve()),)
    assert train[1].origin == f"{root / 'train_metadata.jsonl'}:2"
    meta = source.metadata(train[1])
    assert {k: meta[k] for k in ("tag", "include", "exclude", "t2i_prompt")} == {
        k: ROWS[1][k] for k in ("tag", "include", "exclude", "t2i_prompt")
    }
    assert meta["image"] == train[1].images[0]
    assert source.test_prompts() == [train[2]]
    assert media.load_image(train[2].images[0]).size == (20, 12)


def test_several_images_and_the_images_subfolder(tmp_path):
    (tmp_path / "images").mkdir()
    for name in ("a.png", "b.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / "images" / name)
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "put a in b", "image": ["a.png", "b.png"]}])
    [(prompt, meta)] = read_prompt_file(tmp_path / "train.jsonl")
    assert prompt.images == tuple(str((tmp_path / "images" / n).resolve()) for n in ("a.png", "b.png"))
    assert meta["image"] == list(prompt.images)
    write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "image": 3}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 'image' must be a path or a non-empty list of paths, got 3"):
        read_prompt_file(tmp_path / "bad.jsonl")


def test_bad_source_images_are_one_line_each_at_validation(tmp_path):
    root = tmp_path / "data"
    rows = [
        dict(ROWS[0], image=name)
        for name in ("missing.png", "text.png", "zero.png", "cmyk.jpg", "deep.png", "bomb.png", "ok.png")
    ]
    root.mkdir()
    (root / "text.png").write_text("not an image")
    png_header(root / "zero.png", 0, 0)
    Image.new("CMYK", (4, 4)).save(root / "cmyk.jpg")
    Image.new("I;16", (4, 4)).save(root / "deep.png")
    png_header(root / "bomb.png", 20000, 20000)
    Image.new("RGB", (4, 4)).save(root / "ok.png")
    write_jsonl(root / "train_metadata.jsonl", rows)
    with pytest.raises(RecipeError) as info:
        registry.create("prompts", "folder", path=str(root), test=None)
    lines = [str(e) for e in info.value.errors]
    assert len(lines) == 6, lines
    expected = [
        "does not exist",
        "is not an image",
        "is 0x0: no pixels",
        "is CMYK",
        "has 16 or more bits per channel",
        "is 20000x20000 (400.0 M pixels), more than the decompression-bomb limit",
    ]
    for number, (line, what) in enumerate(zip(lines, expected, strict=True), 1):
        assert line.startswith(f"prompts.train: {root / 'train_metadata.jsonl'}:{number}: source image "), line
        assert (
            what in line and "allowed: an 8-bit" in line and "89.5 M pixels (the decompression-bomb limit)" in line
        ), line
        assert "\n" not in line


def test_bad_images_exit_2_without_traceback(tmp_path):
    root = editing_folder(tmp_path / "data")
    Image.new("CMYK", (4, 4)).save(root / ROWS[2]["image"], format="JPEG")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model: {name: shapes-dit, random_init: true, hidden: 32, heads: 1, layers: 1}\n"
        "sampler: {name: full, steps: 2}\nreward: {name: jpeg-compressibility}\nobjective: {name: grpo}\n"
        f"prompts: {{name: folder, path: {root}}}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "fgrpo.core.cli", "validate", str(recipe)], capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    bad = [line for line in done.stderr.splitlines() if "source image" in line]
    assert len(bad) == 2 and all("is CMYK; allowed" in line for line in bad)  # the train and the test row
    assert "train_metadata.jsonl:3" in bad[0] and "test_metadata.jsonl:1" in bad[1]


# --- which models take which prompts ----------------------------------------------------------------


class Editor:
    source_image_count = (1, 1)


class MultiEditor:
    source_image_count = (1, 3)


def test_count_problems_say_what_the_model_takes():
    edit = Prompt("make it red", images=("/x.png",), origin="d/train_metadata.jsonl:4")
    [t2i] = media.count_problems(object(), [edit, "plain"], name="flux")
    assert t2i.startswith(
        "'make it red' (d/train_metadata.jsonl:4) has 1 source image, but the model flux generates from text only"
    )
    [missing] = media.count_problems(Editor, [edit, "plain", "plain"], name="flux-kontext")
    assert missing.startswith(
        "'plain' has no source image, but the model flux-kontext edits images: it takes exactly 1 per prompt"
    )
    four = Prompt("combine", images=("/a", "/b", "/c", "/d"))
    assert media.count_problems(MultiEditor, [edit, Prompt("two", images=("/a", "/b"))]) == []
    assert media.count_problems(MultiEditor, [four]) == [
        "'combine' has 4 source images; the model MultiEditor takes 1 to 3 per prompt"
    ]


def test_validation_refuses_text_to_image_models_given_sources(tmp_path, monkeypatch):
    root = editing_folder(tmp_path / "data")
    data = {
        "model": {"name": "shapes-dit", "random_init": True},
        "sampler": {"name": "full", "steps": 2},
        "reward": {"name": "jpeg-compressibility"},
        "objective": {"name": "grpo"},
        "prompts": {"name": "folder", "path": str(root)},
    }
    _, errors = recipe_mod.validate(data)
    assert len(errors) == 3 and all(str(e).startswith("prompts: 'Change the number of") for e in errors), errors
    assert "has 1 source image, but the model shapes-dit generates from text only" in str(errors[0])
    # and an editing model given plain prompts
    real_load = registry.load
    monkeypatch.setattr(registry, "load", lambda kind, name: Editor if kind == "model" else real_load(kind, name))
    _, errors = recipe_mod.validate({**data, "prompts": {"name": "list", "train": ["a", "b"]}})
    assert [str(e) for e in errors] == [
        "prompts: 'a' has no source image, but the model shapes-dit edits images: it takes exactly 1 per prompt (an "
        "'image' key in the prompt's row)",
        "prompts: 'b' has no source image, but the model shapes-dit edits images: it takes exactly 1 per prompt (an "
        "'image' key in the prompt's row)",
    ]
    assert recipe_mod.validate(data)[1] == []  # editing prompts for the editing model


def test_sources_false_reads_an_editing_dataset_as_text(tmp_path):
    """A text-to-image recipe on a dataset whose rows also name images (Flow-Factory's
    sharegpt4o_image_mini for FLUX.2 klein): ``sources: false`` keeps ``image`` as metadata."""
    root = editing_folder(tmp_path / "data")
    data = {
        "model": {"name": "shapes-dit", "random_init": True},
        "sampler": {"name": "full", "steps": 2},
        "reward": {"name": "jpeg-compressibility"},
        "objective": {"name": "grpo"},
        "prompts": {"name": "folder", "path": str(root), "sources": False},
    }
    [twice] = recipe_mod.validate(data)[1]  # rows 1 and 2: one instruction, two images, now one prompt
    assert "appears twice with different metadata" in str(twice)
    write_jsonl(root / "train_metadata.jsonl", ROWS[1:])
    assert recipe_mod.validate(data)[1] == []
    source = registry.create("prompts", "folder", path=str(root), sources=False)
    prompts = source.train_prompts()
    assert prompts == [ROWS[1]["prompt"], ROWS[2]["prompt"]] and not any(isinstance(p, Prompt) for p in prompts)
    assert source.metadata(prompts[1])["image"] == str((root / ROWS[2]["image"]).resolve())
    as_file = registry.create("prompts", "text-file", train=str(root / "test_metadata.jsonl"), sources=False)
    assert as_file.train_prompts() == [ROWS[2]["prompt"]]


def test_the_trainer_checks_prompts_of_any_source():
    from fgrpo.core.building import check_prompts

    seen = {}

    class Policy(Editor):
        def use_prompt_metadata(self, lookup):
            seen["lookup"] = lookup

    with pytest.raises(RecipeError, match="'plain' has no source image"):
        check_prompts(Policy(), [Prompt("e", images=("/x",)), "plain"], "prompts", lambda p: {"k": 1})
    assert seen["lookup"]("any") == {"k": 1}


# --- rewards receive the sources ---------------------------------------------------------------------


class SourceReward:
    accepts_sources = True

    def __init__(self):
        self.calls = []

    def __call__(self, outputs, prompts, metadata, *, sources):
        self.calls.append((outputs.shape, list(prompts), sources))
        return RewardResult(
            scores=torch.stack(
                [(o - s[0]).abs().mean() if s else o.mean() for o, s in zip(outputs, sources, strict=True)]
            )
        )


class Spec:
    label, weight, frame_stride = "similar", 1.0, 2


def test_rewards_that_accept_sources_get_them_at_the_outputs_size(tmp_path):
    root = editing_folder(tmp_path)
    source = registry.create("prompts", "folder", path=str(root), test=None)
    prompts = [p for p in source.train_prompts() for _ in range(2)] + ["no source"]
    outputs = torch.rand(len(prompts), 3, 6, 10)
    reward = SourceReward()
    scores, _ = scoring.score(
        [(Spec(), reward)], outputs, prompts, [source.metadata(p) for p in prompts], where="test"
    )
    ((_, _, sources),) = reward.calls
    assert [len(s) for s in sources] == [1, 1, 1, 1, 1, 1, 0]
    first = sources[0][0]
    assert first.shape == (3, 6, 10) and first.dtype == torch.float32 and 0 <= first.min() and first.max() <= 1
    expected = media.to_tensor(Image.open(root / ROWS[0]["image"]), (6, 10))
    assert torch.equal(first, expected) and sources[1][0] is first  # loaded once per prompt
    assert torch.allclose(scores["similar"][0], (outputs[0] - expected).abs().mean())
    # videos: the image reward sees frames 0, 2, ... each with its video's sources
    videos = torch.rand(2, 3, 3, 6, 10)
    reward = SourceReward()
    scoring.score([(Spec(), reward)], videos, prompts[:2], [{}, {}], where="test")
    shape, frame_prompts, frame_sources = reward.calls[0]
    assert shape == (4, 3, 6, 10) and frame_prompts == [prompts[0]] * 4 and len(frame_sources) == 4


def test_plain_rewards_are_called_as_before():
    calls = []

    def plain(outputs, prompts, metadata):
        calls.append(len(prompts))
        return RewardResult(scores=torch.zeros(len(prompts)))

    scoring.score(
        [(Spec(), plain)], torch.rand(2, 3, 4, 4), [Prompt("e", images=("/missing.png",)), "p"], [{}, {}], where="test"
    )
    assert calls == [2]  # nothing loaded for a reward that does not ask


# --- source -> output in grids and the report -------------------------------------------------------------


def test_tiles_show_source_then_output(tmp_path):
    from fgrpo.core import report, visuals
    from fgrpo.core.evaluation import sources_then_outputs

    root = editing_folder(tmp_path / "data")
    prompt = registry.create("prompts", "folder", path=str(root), test=None).train_prompts()[0]
    outputs = torch.zeros(2, 3, 6, 10)
    shown = sources_then_outputs(outputs, [prompt, "plain"])
    assert shown.shape == (2, 3, 6, 21)
    assert torch.equal(shown[0, :, :, :10], media.to_tensor(Image.open(prompt.images[0]), (6, 10)))
    assert torch.equal(shown[0, :, :, 10], torch.ones(3, 6)) and torch.equal(shown[0, :, :, 11:], outputs[0])
    assert torch.equal(shown[1, :, :, 11:], outputs[1]) and bool((shown[1, :, :, :11] == 1).all())  # no source: blank
    assert sources_then_outputs(outputs, ["a", "b"]) is outputs
    grid = visuals.grid_image(shown, ["edit", "plain"], cell=32)
    assert grid.size[0] == 2 * round(32 * 21 / 6) + 2
    assert report.tile_class({"sources": 1}) == "tile edit1" and report.tile_class({}) == "tile"
