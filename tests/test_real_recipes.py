"""The real-scale recipes (SD3.5-M, FLUX.1-dev, FLUX.2, Qwen-Image, Z-Image, Wan 2.1/2.2, HunyuanVideo 1.5)
validate: every component exists, every key is known and in range. They are not run here (no GPU, no weights).

The datasets they read (flow_grpo's dataset/ocr, dataset/geneval, dataset/pickscore) are not
in the repository; each test writes a tiny stand-in of the same layout into a temporary working
directory, and first checks that the recipe is refused without it."""

from __future__ import annotations

import json

import pytest

from fgrpo.core import cli

RECIPES = [
    "sd35m-ocr",
    "sd35m-geneval",
    "sd35m-pickscore",
    "flux-pickscore",
    "qwen-image-ocr",
    "qwen-image-pickscore",
    "wan-ocr",
    "sd35m-preference-mix",
    "sd35m-vlm-judge",
    "sd35m-geneval-remote",
    "flux2-t2i",
    "flux2-klein-pickscore",
    "z-image-pickscore",
    "z-image-turbo-pickscore",
    "wan22-t2v-pickscore",
    "wan22-i2v-pickscore",
    "hunyuan-video-1.5-pickscore",
    "flux-kontext-counting-edit",
    "qwen-image-edit-counting-edit",
    "sd35m-nft-geneval",
    "sd35m-nft-ocr",
    "sd35m-nft-pickscore",
    "sd35m-nft-multi-reward",
    "sd35m-awm-geneval",
    "sd35m-awm-ocr",
    "sd35m-awm-pickscore",
    "sd35m-pref-grpo",
    "flux-pref-grpo",
]


def stand_in_datasets(folder):
    """flow_grpo's layout: text prompts for OCR and PickScore, GenEval's metadata JSONL; Flow-Factory's
    t2is (JSONL prompts) and sharegpt4o_image_mini (JSONL rows naming an image in images/); Pref-GRPO's
    data/unigenbench_train_data.txt."""
    for task in ("ocr", "pickscore"):
        (folder / "dataset" / task).mkdir(parents=True)
        for split in ("train", "test"):
            (folder / "dataset" / task / f"{split}.txt").write_text('a sign that says "fgrpo"\na cat on a mat\n')
    (folder / "data").mkdir()  # Pref-GRPO's prompt file
    (folder / "data" / "unigenbench_train_data.txt").write_text("a whale over the Forbidden City\na cat on a mat\n")
    (folder / "dataset" / "geneval").mkdir(parents=True)
    row = {
        "prompt": "a photo of a cat",
        "tag": "single_object",
        "include": [{"class": "cat", "count": 1}],
        "exclude": [],
    }
    for split in ("train", "test"):
        (folder / "dataset" / "geneval" / f"{split}_metadata.jsonl").write_text(json.dumps(row) + "\n")
    from PIL import Image  # the source images of the editing and image-to-video datasets

    (folder / "dataset" / "counting_edit" / "generated_images").mkdir(parents=True)
    Image.new("RGB", (64, 64), (120, 80, 40)).save(
        folder / "dataset" / "counting_edit" / "generated_images" / "image_0.jpg"
    )
    edit = {
        "tag": "counting",
        "include": [{"class": "cat", "count": 2}],
        "exclude": [{"class": "cat", "count": 3}],
        "t2i_prompt": "a photo of one cat",
        "prompt": "Change the number of cat in the image to two.",
        "image": "generated_images/image_0.jpg",
    }
    for split in ("train", "test"):
        (folder / "dataset" / "counting_edit" / f"{split}_metadata.jsonl").write_text(json.dumps(edit) + "\n")
    (folder / "dataset" / "t2is").mkdir(parents=True)
    (folder / "dataset" / "sharegpt4o_image_mini" / "images").mkdir(parents=True)
    for split in ("train", "test"):
        (folder / "dataset" / "t2is" / f"{split}.jsonl").write_text(json.dumps({"prompt": "a cat on a mat"}) + "\n")
        edit = {"prompt": "the same room in watercolour", "image": "v2v_0.png"}
        (folder / "dataset" / "sharegpt4o_image_mini" / f"{split}.jsonl").write_text(json.dumps(edit) + "\n")
    Image.new("RGB", (64, 64), (40, 80, 120)).save(
        folder / "dataset" / "sharegpt4o_image_mini" / "images" / "v2v_0.png"
    )


@pytest.mark.parametrize("name", RECIPES)
def test_real_recipe_validates(name, root, tmp_path, monkeypatch, capsys):
    recipe = root / "recipes" / f"{name}.yaml"
    text = recipe.read_text()
    assert "# Hardware:" in text and "GB" in text, "say which GPUs the recipe expects"
    assert "# Run: accelerate launch" in text
    monkeypatch.chdir(tmp_path)
    assert cli.main(["validate", str(recipe)]) == 2  # without its dataset the recipe is refused ...
    assert "prompts.path" in capsys.readouterr().err
    stand_in_datasets(tmp_path)
    code = cli.main(["validate", str(recipe)])  # ... and with it, it validates
    assert code == 0, capsys.readouterr().err
    assert f"{name}.yaml: ok" in capsys.readouterr().out


def test_every_model_reward_is_named_by_a_shipped_recipe(root):
    """Each reward issue 11 delivers is exercised by at least one recipe users can start from."""
    import yaml

    named = set()
    for path in (root / "recipes").glob("*.yaml"):
        rewards = yaml.safe_load(path.read_text()).get("reward", [])
        for spec in rewards if isinstance(rewards, list) else [rewards]:
            named.add(spec if isinstance(spec, str) else spec["name"])
    wanted = {"ocr", "pickscore", "geneval", "clip-score", "aesthetic", "hpsv2", "imagereward", "vlm-judge", "remote"}
    assert wanted <= named, f"no shipped recipe names {sorted(wanted - named)}"


@pytest.mark.parametrize("name", RECIPES)
def test_run_line_launches_with_the_recipes_mixed_precision(name, root):
    """fgrpo refuses a recipe whose train.mixed_precision differs from the launcher's: the command in
    the recipe's header must agree with it (the sd35m recipes ask for flow_grpo's fp16)."""
    import shlex

    import yaml

    text = (root / "recipes" / f"{name}.yaml").read_text()
    run = shlex.split(next(line for line in text.splitlines() if line.startswith("# Run: "))[len("# Run: ") :])
    launched = yaml.safe_load((root / run[run.index("--config_file") + 1]).read_text())["mixed_precision"]
    if "--mixed_precision" in run:
        launched = run[run.index("--mixed_precision") + 1]
    wanted = yaml.safe_load(text)["train"].get("mixed_precision", "auto")
    assert wanted in ("auto", launched), f"{name}: the recipe asks for {wanted}, its Run line launches {launched}"
