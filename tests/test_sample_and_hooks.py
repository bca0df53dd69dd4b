from __future__ import annotations

import json
import textwrap

from _helpers import run_fgrpo
from fgrpo.core import cli


def test_sample_writes_outputs_and_index(root, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("target 1 1\ntarget -1 0.5\n")
    recipe = str(root / "recipes" / "vector.yaml")
    run_dir = tmp_path / "run"
    assert cli.main(["compose", recipe, "--out", str(run_dir), "--quiet", "--set", "train.iterations=2"]) == 0
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    assert cli.main(["sample", recipe, "--prompts", str(prompts), "--n", "3", "--out", str(base)]) == 0
    assert (
        cli.main(
            [
                "sample",
                recipe,
                "--prompts",
                str(prompts),
                "--n",
                "3",
                "--out",
                str(tuned),
                "--checkpoint",
                str(run_dir / "checkpoints" / "last"),
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (base / "index.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["index"]) for r in rows] == [
        (p, k) for p in ("target 1 1", "target -1 0.5") for k in range(3)
    ]
    assert all((base / r["file"]).is_file() for r in rows)
    # same seed, different weights: different samples; same weights and seed: identical samples
    again = tmp_path / "again"
    assert cli.main(["sample", recipe, "--prompts", str(prompts), "--n", "3", "--out", str(again)]) == 0
    assert (base / rows[0]["file"]).read_bytes() == (again / rows[0]["file"]).read_bytes()
    assert (base / rows[0]["file"]).read_bytes() != (tuned / rows[0]["file"]).read_bytes()


def test_sample_writes_each_rewards_scores_and_what_it_read(root, tmp_path, capsys):
    """``index.jsonl`` holds, per image, every reward's score and its per-sample details (the shapes
    verifier's reading of that very PNG); ``--no-scores`` leaves the rewards unbuilt."""
    import torch
    from PIL import Image

    from fgrpo.core import media
    from fgrpo.worlds.shapes.verifier import ShapesVerifier

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\ntwo blue squares\n")
    out = tmp_path / "scored"
    args = ["sample", str(root / "recipes" / "shapes.yaml"), "--prompts", str(prompts), "--n", "2", "--steps", "8"]
    assert cli.main([*args, "--out", str(out)]) == 0
    assert "scored by shapes" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(set(r["scores"]) == {"shapes"} for r in rows)
    images = torch.stack([media.to_tensor(Image.open(out / r["file"])) for r in rows])
    again = ShapesVerifier(score="strict")(images, [r["prompt"] for r in rows], [{}] * len(rows))
    for i, row in enumerate(rows):
        read = row["details"]["shapes"]
        assert read["read"] == again.details["read"][i] and read["category"] == again.details["category"][i]
        assert row["scores"]["shapes"] == read["accuracy"] == again.scores[i].item()
    assert any(r["scores"]["shapes"] == 1.0 for r in rows)  # the shipped base draws some of them right

    plain = tmp_path / "plain"
    assert cli.main([*args, "--out", str(plain), "--no-scores"]) == 0
    rows = [json.loads(line) for line in (plain / "index.jsonl").read_text().splitlines()]
    assert rows and all(set(r) == {"file", "prompt", "seed", "index"} for r in rows)


def test_sample_bad_checkpoint_exits_2(root, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("target 1 1\n")
    code = cli.main(
        [
            "sample",
            str(root / "recipes" / "vector.yaml"),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "o"),
            "--checkpoint",
            str(tmp_path),
        ]
    )
    assert code == 2
    assert "--checkpoint:" in capsys.readouterr().err


def test_hook_plugin_sees_iterations_and_adds_a_command(root, tmp_path):
    (tmp_path / "my_hooks.py").write_text(
        textwrap.dedent(
            """
        import json, os
        from fgrpo.core.hookspecs import hookimpl

        LOG = os.environ["HOOK_LOG"]

        @hookimpl
        def fgrpo_iteration_end(run, iteration, metrics):
            with open(LOG, "a") as fh:
                fh.write(json.dumps({"hook": "iteration", "iteration": iteration}) + "\\n")

        @hookimpl
        def fgrpo_checkpoint_saved(run, iteration, path):
            with open(LOG, "a") as fh:
                fh.write(json.dumps({"hook": "checkpoint", "iteration": iteration}) + "\\n")

        @hookimpl
        def fgrpo_register_commands(subparsers):
            p = subparsers.add_parser("hello", help="say hello")
            p.set_defaults(handler=lambda args: print("hello from a plugin") or 0)
        """
        )
    )
    info = tmp_path / "my_hooks-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-hooks\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fgrpo.plugins]\nmy-hooks = my_hooks\n")
    log = tmp_path / "hooks.jsonl"
    env = {"PYTHONPATH": str(tmp_path), "HOOK_LOG": str(log)}
    hello = run_fgrpo("hello", env=env)
    assert hello.returncode == 0 and "hello from a plugin" in hello.stdout
    done = run_fgrpo(
        "compose",
        str(root / "recipes" / "vector.yaml"),
        "--out",
        str(tmp_path / "run"),
        "--quiet",
        "--set",
        "train.iterations=3",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events == [
        {"hook": "iteration", "iteration": 1},
        {"hook": "iteration", "iteration": 2},
        {"hook": "iteration", "iteration": 3},
        {"hook": "checkpoint", "iteration": 3},
    ]
    listing = run_fgrpo("plugins", "--json", env=env)
    assert {"name": "my-hooks", "status": "ok"} in json.loads(listing.stdout)["hook_plugins"]
