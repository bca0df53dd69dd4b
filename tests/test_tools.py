"""The tools under tools/ that the closing notes quote figures from."""

from __future__ import annotations

import re

import pytest
import torch

from _helpers import load_tool


def _load(root, name):
    return load_tool(f"{name}.py")


def test_reference_parity_sizes_lora_counts_on_the_real_configs(root):
    """The LoRA figures docs/method.md and docs/backbones.md quote (issue 21, item 4), counted on the
    published SD3.5-M and Wan 2.1 1.3B transformer configs built on the meta device."""
    pytest.importorskip("diffusers")
    from diffusers import SD3Transformer2DModel, WanTransformer3DModel

    from fgrpo.models.lora import JOINT_ATTENTION_LORA_TARGETS
    from fgrpo.models.wan import WAN_LORA_TARGETS

    sizes = _load(root, "reference_parity_sizes")
    old, new = (
        sizes.lora_parameters(SD3Transformer2DModel, sizes.SD35_MEDIUM, t)
        for t in (sizes.OLD_JOINT, JOINT_ATTENTION_LORA_TARGETS)
    )
    assert (
        (old[0] - new[0], new[0]) == (52, 191)
        and round((old[1] - new[1]) / 1e6, 2) == 5.11
        and round(old[1] / new[1] - 1, 2) == 0.27
    )
    wan_old = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    old, new = (sizes.lora_parameters(WanTransformer3DModel, sizes.WAN21_1_3B, t) for t in (wan_old, WAN_LORA_TARGETS))
    assert new[0] == 240 and round(old[1] / new[1] - 1, 2) == 0.85


def test_memory_estimate_counts_the_pipelines_own_sizes(root, tmp_path, capsys, monkeypatch):
    """tools/memory.py on a tiny Wan 2.2 MoE pipeline (both experts with LoRA): parameters counted
    from the configs on the meta device equal the built modules', the LoRA size equals peft's, and
    the launch kinds split what they split."""
    pytest.importorskip("diffusers")
    import json

    import yaml

    from fgrpo.core import registry
    from fgrpo.models.testing import build_tiny_wan22_pipeline

    memory = _load(root, "memory")
    pipe = build_tiny_wan22_pipeline(tmp_path / "tiny")
    recipe = {
        "model": {
            "name": "wan",
            "path": str(tmp_path / "tiny"),
            "resolution": 32,
            "num_frames": 5,
            "lora": {"rank": 4},
            "max_sequence_length": 16,
            "guidance_scale": 4.0,
        },
        "sampler": {"name": "fast", "steps": 4, "window": 2},
        "train": {"prompts_per_iteration": 4, "group_size": 4, "micro_batch_size": 2, "ema_decay": 0.9},
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert memory.main([str(tmp_path / "r.yaml"), "--gpus", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    sizes = result["sizes"]
    assert sizes["exact"] and sizes["transformers"] == [
        sum(p.numel() for p in m.parameters()) for m in (pipe.transformer, pipe.transformer_2)
    ]
    assert sizes["text"] == sum(p.numel() for p in pipe.text_encoder.parameters())
    policy = registry.create("model", "wan", **{k: v for k, v in recipe["model"].items() if k != "name"}, device="cpu")
    assert sum(sizes["lora"]) == sum(
        p.numel() for p in policy.trainable_parameters()
    )  # peft's adapter on both experts
    assert result["tokens"] == [2 * 2 * 2, 16]
    kinds = result["kinds"]
    assert (
        kinds["fsdp"]["weights"] < kinds["ddp"]["weights"]
        and kinds["deepspeed-zero2"]["weights"] == kinds["ddp"]["weights"]
    )
    assert kinds["deepspeed-zero2"]["grads+adamw"] == kinds["ddp"]["grads+adamw"] / 2
    assert kinds["zero2-offload"]["grads+adamw"] == kinds["deepspeed-zero2"]["grads+adamw"] / 3
    assert (
        kinds["deepspeed-zero3"]["weights"] == kinds["fsdp"]["weights"]
        and kinds["deepspeed-zero3"]["ema"] == kinds["fsdp"]["ema"]
    )
    assert (
        kinds["zero3-offload"]["weights"] < kinds["deepspeed-zero3"]["weights"] and kinds["zero3-offload"]["ema"] == 0
    )
    assert kinds["zero3-offload"]["grads+adamw"] == kinds["zero2-offload"]["grads+adamw"]
    assert result["activations"]["checkpointing"] < result["activations"]["none"]
    assert memory.main([str(tmp_path / "r.yaml"), "--gpus", "0"]) == 2

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # nothing cached: the published sizes
    assert memory.main([str(root / "recipes" / "wan22-t2v-pickscore.yaml"), "--gpus", "8"]) == 0
    printed = capsys.readouterr().out
    assert "| fsdp |" in printed and "published, approximate" in printed and "14.30B + 14.30B" in printed


def test_no_tool_is_named_like_an_installed_module(root):
    """A tool run as a script has its own folder first on sys.path, so a sibling named like an
    installed module stands in for it: tools/bench/kernels.py took the place of Hugging Face's
    ``kernels``, which transformers probes for, and ``python tools/bench/objectives.py`` failed at
    its first diffusers import."""
    import importlib.machinery
    import sys
    from pathlib import Path

    tools = (Path(root) / "tools").resolve()
    search = [p for p in sys.path if not Path(p or ".").resolve().is_relative_to(tools)]
    shadowing = sorted(
        str(path.relative_to(root))
        for path in tools.rglob("*.py")
        if path.stem in sys.builtin_module_names or importlib.machinery.PathFinder.find_spec(path.stem, search)
    )
    assert shadowing == []


def test_recipe_times_measures_each_thread_count_and_writes_the_header_line(root, tmp_path, monkeypatch, capsys):
    """The figures behind each CPU recipe's '# time:' line: a fresh process per thread count, the
    whole recipe estimated from its iterations and evaluations."""
    bench = load_tool("bench/recipe_times.py", "recipe_times_bench")
    shipped = (root / "recipes" / "vector.yaml").read_text()
    (tmp_path / "vector.yaml").write_text(bench.TIME_LINE.sub("# time: old", shipped))
    monkeypatch.setattr(bench, "RECIPES", tmp_path)
    assert bench.main(["vector", "--threads", "1", "--iterations", "3", "--skip", "1", "--write"]) == 0
    printed = capsys.readouterr().out
    row = next(line.split() for line in printed.splitlines() if line.startswith("vector "))
    assert row[1] == "1" and float(row[2]) > 0
    line = next(ln for ln in (tmp_path / "vector.yaml").read_text().splitlines() if ln.startswith("# time:"))
    assert " on 1 thread (" in line and "s an iteration" in line and "old" not in line
    # the estimate is set-up + iterations x pace + evaluations x their pace, from the recipe as shipped
    figures = {"stages": [{"iteration_s": 2.0, "eval_s": 10.0}], "setup_s": 5.0}
    assert bench.whole(figures, [(100, 11)]) == 5.0 + 200.0 + 110.0
    # a recipe in stages: each stage at its own pace, one set-up
    figures["stages"].append({"iteration_s": 1.0, "eval_s": 20.0})
    assert bench.whole(figures, [(100, 11), (30, 2)]) == 5.0 + 200.0 + 110.0 + 30.0 + 40.0
    assert [n for n, _ in bench.plan_of("driving")] == [900, 300]


# --- tools/gpu/bench_real_size.py: every real backbone (recipe mode) and those with a published config ---


def test_real_size_bench_builds_every_published_backbone_at_its_size(root):
    """Each backbone whose policy declares a published transformer config is built from it at real
    size (on the meta device: nothing allocated): every published key accepted, only the encoders'
    widths taken from the tiny pipeline (a few parameters of the text projection), and the count
    within 12% of the published figure (SD3.5-Medium's "2.5B" is its marketing round-up of 2.24B)."""
    pytest.importorskip("diffusers")
    import torch

    bench = load_tool("gpu/bench_real_size.py")
    backbones = bench.published_backbones()
    assert {"sd3", "flux", "qwen-image", "wan"} <= set(backbones)
    for name, (checkpoint, published) in backbones.items():
        tiny = bench.tiny_builder(name)().transformer
        config, taken = bench.real_config(published, tiny, shrink=False)
        assert set(published.config) == set(config), f"{name}: published keys the class does not take"
        assert set(taken) <= set(bench.STAND_IN_KEYS), name
        assert all(config[k] == published.config[k] for k in set(config) - set(taken)), name
        with torch.device("meta"):
            count = sum(p.numel() for p in type(tiny)(**config).parameters())
        assert abs(count / published.transformer - 1) < 0.12, f"{name} ({checkpoint}): {count / 1e9:.3f}B"


def _one_recipe_per_checkpoint() -> list[str]:
    """The shipped real recipes ``--all`` runs (one per backbone and checkpoint)."""
    from pathlib import Path

    pytest.importorskip("diffusers")
    from fgrpo.models import real_size

    root = Path(__file__).resolve().parents[1] / "recipes"
    return [p.name for p in real_size.one_per_checkpoint(real_size.real_recipes(root))]


#: shrunk on the CPU in the default suite: Wan 2.2 T2V (two experts) and HunyuanVideo 1.5 (whose forward fake
#: tensors cannot pass), 3.6 and 8.4 s on 2 shared cores; SD3's run is the --memory test's. The eleven others
#: are slow (2.1-13.4 s each, about 44 s together)
DEFAULT_SHRUNK = {"wan22-t2v-pickscore.yaml", "hunyuan-video-1.5-pickscore.yaml"}


def test_real_size_bench_all_covers_every_real_backbone_at_its_published_size(root, capsys):
    """``--all`` runs one recipe of every shipped real backbone and checkpoint (FLUX.1 Kontext, FLUX.2
    [dev] and [klein], Qwen-Image-Edit, Z-Image, both Wan 2.2 experts, HunyuanVideo 1.5 among them),
    each transformer built from fgrpo memory's config (fgrpo.models.fake_size.transformer_config,
    here on the meta device) at the published parameter count within 12% (SD3.5-Medium's "2.5B" is
    its marketing round-up of 2.24B)."""
    pytest.importorskip("diffusers")
    import torch
    import yaml

    from fgrpo.core import registry
    from fgrpo.models import fake_size, real_size

    names = _one_recipe_per_checkpoint()
    assert load_tool("gpu/bench_real_size.py").main(["--list"]) == 0
    assert capsys.readouterr().out.split() == [f"recipes/{n}" for n in names]
    models = [yaml.safe_load((root / "recipes" / n).read_text())["model"] for n in names]
    assert {m["name"] for m in models} == set(fake_size.TINY)
    assert {m["path"] for m in models} >= {
        "black-forest-labs/FLUX.1-Kontext-dev",
        "black-forest-labs/FLUX.2-dev",
        "black-forest-labs/FLUX.2-klein-9B",
        "Qwen/Qwen-Image-Edit",
        "Tongyi-MAI/Z-Image",
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
    }
    for model in models:
        cls = registry.load("model", model["name"])
        tiny = fake_size.tiny_pipeline(model["name"], model["path"])
        configs = real_size.transformer_configs(cls, model["path"], tiny, shrink=False)
        count = 0
        for attr, (config, _) in configs.items():
            with torch.device("meta"):
                count += sum(p.numel() for p in type(getattr(tiny, attr))(**config).parameters())
        published = cls.published[model["path"]]
        want = published.transformer * published.experts
        assert len(configs) == published.experts, model["path"]
        assert abs(count / want - 1) < 0.12, f"{model['path']}: {count / 1e9:.3f}B against {want / 1e9:.3f}B"


def test_shrunk_config_takes_the_tiny_sizes_and_keeps_flags_and_position_tables():
    from fgrpo.models.real_size import shrunk_config

    published = {
        "num_layers": 24,
        "axes_dims_rope": [16, 56, 56],
        "qk_norm": "rms_norm",
        "guidance_embeds": True,
        "axes_lens": [1536, 512, 512],
        "eps": 1e-6,
        "num_heads": 24,
    }
    tiny = {
        "num_layers": 2,
        "axes_dims_rope": [2, 3, 3],
        "qk_norm": "layer_norm",
        "guidance_embeds": False,
        "axes_lens": [256, 32, 32],
        "eps": 1e-5,
    }
    assert shrunk_config(published, tiny) == {**published, "num_layers": 2, "axes_dims_rope": [2, 3, 3]}


@pytest.mark.parametrize(
    "name",
    [n if n in DEFAULT_SHRUNK else pytest.param(n, marks=pytest.mark.slow) for n in _one_recipe_per_checkpoint()],
)
def test_real_size_bench_runs_every_real_recipe_shrunk_on_the_cpu(root, capsys, name):
    """``--recipe R --shrink``: the recipe's policy with its transformer(s) at the tiny sizes runs the
    recipe's sampler, one update micro-batch and the gather; each phase's line says its seconds and
    that no CUDA peak is read here."""
    bench = load_tool("gpu/bench_real_size.py")
    assert bench.main(["--recipe", str(root / "recipes" / name), "--shrink"]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if f": {name}, " in line)
    assert "(shrunk)" in head and "CPU, 1 of 8 processes" in head
    for phase in ("load", "rollout", "update", "gather"):
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{phase}:"))
        assert re.fullmatch(rf"\s*{phase}: +\d+\.\d\d s; .*", line), line  # a gather may take under 5 ms: 0.00
        assert "max_memory_allocated - (no CUDA); fgrpo memory -" in line


def test_real_size_bench_prints_fgrpo_memorys_figure_per_phase(root, tmp_path, capsys, monkeypatch):
    """``--memory``: each phase's line carries fgrpo memory's accelerator figure (ddp, ``--gpus``),
    the one ``fgrpo.models.memory.measure`` gives; ``--memory-dir`` reads it from its JSON, and a
    formula-only JSON (fake tensors stopped) gives the formula for every phase."""
    pytest.importorskip("diffusers")
    import json

    from fgrpo.models import memory, memory_formula

    bench = load_tool("gpu/bench_real_size.py")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_SD3)
    data, _ = memory_formula.read_recipe(str(recipe), [])
    result = memory.measure(data, 2, "ddp")
    wants = {
        p: f"fgrpo memory {memory.total(v, 'accelerator') / memory.GIB:.2f} GiB (measured)"
        for p, v in result["phases"].items()
    }
    calls = []
    monkeypatch.setattr(memory, "measure", lambda *a: calls.append(a[1:]) or result)  # measured once, above
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "tiny.json").write_text(json.dumps(result, default=float))  # fgrpo memory --json
    for how in (["--memory"], ["--memory-dir", str(tmp_path / "mem")]):
        assert bench.main(["--recipe", str(recipe), "--gpus", "2", *how]) == 0
        out = capsys.readouterr().out
        for phase, want in wants.items():
            line = next(line for line in out.splitlines() if line.strip().startswith(f"{phase}:"))
            assert want in line, (how, phase, line)
    assert calls == [(2, "ddp")]
    stopped = {"measured": None, "fake_tensors_stopped": "x", "formula": {"total": 3 * memory.GIB}, "fits": True}
    (tmp_path / "mem" / "tiny.json").write_text(json.dumps(stopped))
    assert bench.main(["--recipe", str(recipe), "--memory-dir", str(tmp_path / "mem")]) == 0
    out = capsys.readouterr().out
    assert out.count("fgrpo memory 3.00 GiB (formula)") == 4
    assert bench.main(["--recipe", str(tmp_path / "none.yaml")]) == 2
    assert "--recipe: got " in capsys.readouterr().err


TINY_SD3 = """
model: {name: sd3, path: tiny/sd3-not-published, dtype: float32, resolution: 64, lora: {rank: 4}}
sampler: {name: full, steps: 2, kernel: {name: sde, eta: 0.7}}
objective: {name: grpo}
reward: {name: jpeg}
prompts: {name: folder, path: nowhere}
train: {prompts_per_iteration: 2, group_size: 2, micro_batch_size: 1}
"""


def test_real_size_bench_reads_the_expected_peak_and_refuses_an_unknown_backbone(root, tmp_path, capsys):
    import json

    bench = load_tool("gpu/bench_real_size.py")
    for text, want in (("1073741824", 1.0), ('{"total": 2147483648}', 2.0), ('{"total_gib": 1.5}', 1.5)):
        (tmp_path / "e.json").write_text(text)
        assert bench.expected_peak(str(tmp_path / "e.json")) == want * bench.GIB
    (tmp_path / "e.json").write_text(json.dumps({"kinds": {"ddp": {"total": 5.0}, "fsdp": {"total": 1.0}}}))
    assert bench.expected_peak(str(tmp_path / "e.json")) == 5.0
    assert bench.main(["--backbone", "no-such-model"]) == 2
    assert "--backbone: got 'no-such-model'; allowed: " in capsys.readouterr().err


def test_memory_counts_the_sparse_samplers_trained_steps_as_it_trains(root):
    """tools/memory.py's activations scale with the trained steps: for ``sparse`` the steps a
    rollout of the sampler itself records (HunyuanVideo 1.5's recipe: 8 of 16)."""
    import torch

    from fgrpo.core.testing.toys import GaussianPolicy
    from fgrpo.models import memory_formula as memory  # tools/memory.py's formula
    from fgrpo.samplers.sparse import SparseSampler

    for keys in ({"steps": 16, "trained": 8, "step_range": [0, 9]}, {"steps": 6}, {"steps": 6, "step_range": [2, 5]}):
        sampler = SparseSampler(**keys)
        traj = sampler.rollout(GaussianPolicy(), ["a"], 2, generator=torch.Generator().manual_seed(0))
        assert memory._trained_steps({"name": "sparse", **keys}) == traj.num_trained_steps, keys


# --- tools/bench/planners.py: the planners in both worlds, resumable -------------------------------

#: a planner recipe shrunk to one iteration of two prompts, one scenario per type, one highway-env episode
SMALL_PLANNER = [
    "train.iterations=1",
    "train.prompts_per_iteration=2",
    "train.group_size=2",
    "prompts.train_seeds=1",
    "prompts.test_seeds=1",
    "prompts.closed_loop=null",
    "prompts.highway={episodes: 1, seed: 0, seconds: 5.0, configs: [{lanes: 3, vehicles: 10}]}",
    "eval.every=0",
    "train.checkpoint_every=1",
]


@pytest.mark.slow
def test_planners_bench_trains_evaluates_in_both_worlds_and_resumes(tmp_path, capsys):
    """Shrunk: the base and one trained planner, our gold, one highway-env configuration behind the
    filter and shadow mode; a second call finds every cell saved and only prints the table."""
    bench = load_tool("bench/planners.py", "planners_bench")
    small = [*SMALL_PLANNER, "sampler.steps=2", "eval.steps=2"]
    argv = ["--work", str(tmp_path), "--seeds", "0", "--planners", "bc,driving-highway.yaml", "--episodes", "1"]
    argv += ["--shadow-episodes", "1", "--only", "gold,highway:aggressive+filter,shadow:highway"]
    argv += [f"--set={item}" for item in small]
    assert bench.main(argv) == 0
    cells = sorted(p.name for p in (tmp_path / "cells").glob("*.json"))
    assert cells == sorted(
        f"{p}-0-{n}.json"
        for p in ("bc", "driving-highway.yaml")
        for n in ("gold", "highway_aggressive+filter", "shadow_highway")
    )
    first = capsys.readouterr().out
    row = next(line for line in first.splitlines() if line.startswith("driving-highway.yaml")).split()
    # planner, seed, gold (CL, collisions), highway-env behind the filter (+ interventions), shadow (ADE, collisions)
    assert len(row) == 2 + 2 + 3 + 2 and "-" not in row
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "cells").glob("*.json")}
    assert bench.main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing was run again
    assert capsys.readouterr().out.splitlines()[1:] == first.splitlines()[1:]


@pytest.mark.slow
def test_planners_bench_trains_a_recipe_in_stages_with_its_overrides_in_every_stage(tmp_path):
    """``driving.yaml`` trains its first stage, exports its network and trains the second from it
    (``then:``), both shrunk by the bench's overrides; its evaluation builds from the first stage's keys."""
    import yaml
    from safetensors.torch import load_file

    bench = load_tool("bench/planners.py", "planners_bench_stages")
    second = bench.train_cell(tmp_path, "driving.yaml", 0, SMALL_PLANNER)
    judged = bench.evaluate("driving.yaml", second, "{name: driving-closed-loop}", SMALL_PLANNER)
    assert 0.0 <= judged["cl_score"] <= 1.0
    run = tmp_path / "runs" / "driving.yaml-0"
    first = run / "stages" / "1"
    resolved = yaml.safe_load((run / "recipe.resolved.yaml").read_text())
    assert resolved["model"]["path"] == str(first / "export" / "iter_000001" / "trajectory.safetensors")
    shrunk = (resolved["objective"]["name"], resolved["train"]["iterations"], resolved["eval"]["every"])
    assert shrunk == ("grpo", 1, 0)
    assert second == run / "checkpoints" / "iter_000001" / "trainable.safetensors"
    exported = load_file(first / "export" / "iter_000001" / "trajectory.safetensors")
    trained = load_file(first / "checkpoints" / "iter_000001" / "trainable.safetensors")
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    after = load_file(second)
    assert any(not torch.equal(after[k], trained[k]) for k in trained)
