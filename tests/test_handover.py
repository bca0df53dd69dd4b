"""What a run hands over to its user, tried on one short tiny-SD3 run started as a user starts it
(the `fgrpo` command, output to a log file, umask 027):

- a LoRA that does nothing is never handed over silently: an EMA that received no update (a
  short run with ``ema_every`` 8), the EMA's empty export, each get a warning at the end of the
  run and in ``fgrpo export``; ``--no-ema`` exports the trained weights; evaluation says which
  weights it used;
- every export is also a PEFT adapter folder that ``PeftModel.from_pretrained`` loads with the
  outputs ``pipe.load_lora_weights`` gives;
- the log file holds fgrpo's lines only: no diffusers/transformers progress bar;
- every file the run and the export write follows the umask (0640 here), safetensors included.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.core import cli, logs, weights
from fgrpo.models.testing import build_tiny_sd3_pipeline

SEQ, ITERATIONS, UMASK = 8, 2, 0o027
FGRPO = Path(sys.executable).with_name("fgrpo")


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """(folder, log text, pipeline path): 2 iterations, EMA every 8 optimizer steps, evaluated
    at the start and the end; the command's stdout and stderr go to one log file."""
    tmp = tmp_path_factory.mktemp("handover")
    model = tmp / "tiny-sd3"
    build_tiny_sd3_pipeline(model)
    recipe = tmp / "recipe.yaml"
    recipe.write_text(
        textwrap.dedent(f"""
        seed: 0
        model: {{name: sd3, path: {model}, device: cpu, max_sequence_length: {SEQ}, lora: {{rank: 4}}}}
        sampler: {{name: full, steps: 2, kernel: {{name: sde, eta: 0.7}}}}
        reward: {{name: jpeg-compressibility}}
        objective: {{name: grpo, clip_range: 1.0e-3}}
        prompts: {{name: list, train: ["a red circle", "a blue square"], test: ["a green circle"]}}
        train: {{iterations: {ITERATIONS}, group_size: 2, prompts_per_iteration: 2, lr: 0.05, ema_decay: 0.9,
                 ema_every: 8}}
        eval: {{every: {ITERATIONS}, steps: 2}}
        log: {{trackers: [tensorboard], plots: false}}
    """)
    )
    run = tmp / "run"
    log = tmp / "run.io.log"
    env = {k: v for k, v in os.environ.items() if k not in logs.LIBRARY_ENV and k != logs.ENV}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    with log.open("w") as fh:
        done = subprocess.run(
            [str(FGRPO), "compose", str(recipe), "--out", str(run)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp,
            timeout=600,
            preexec_fn=lambda: os.umask(UMASK),
        )
    text = log.read_text()
    assert done.returncode == 0, text[-3000:]
    return run, text, model


@pytest.fixture
def umask():
    old = os.umask(UMASK)
    yield
    os.umask(old)


def up_projections(folder: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    state = load_file(str(folder / "pytorch_lora_weights.safetensors"))
    return [v for k, v in state.items() if "lora_B" in k]


def test_the_run_warns_that_its_ema_never_moved_and_its_export_is_empty(short_run):
    run, log, _ = short_run
    assert f"warning: the EMA received no update in {ITERATIONS} optimizer step(s) (train.ema_every: 8)" in log
    assert "`fgrpo export --no-ema` writes the trained weights and `fgrpo sample --no-ema` draws from them" in log
    handed_over = (
        run / "checkpoints" / os.readlink(run / "checkpoints" / "last")
    )  # the folder itself, never read through last
    assert f"warning: the exported LoRA in {handed_over / 'export'} is empty" in log
    evals = [line for line in log.splitlines() if line.startswith("eval at iteration")]
    assert [line.split(":")[0] for line in evals] == [
        f"eval at iteration {i}/{ITERATIONS} ({s}, EMA weights after 0 updates)"
        for i, s in zip((0, ITERATIONS), re.findall(r"\((\d+\.\d s), EMA", log), strict=True)
    ]
    assert all(not torch.any(b) for b in up_projections(run / "checkpoints" / "last" / "export"))
    report = (run / "report.html").read_text()  # the report says it too, and which weights were evaluated
    assert (
        '<p class="warning">warning: the EMA received no update' in report
        and "is empty: every up-projection" in report
    )
    assert (
        "evaluated with</th><td>the EMA of the trained weights (decay 0.9, updated every 8 optimizer steps)" in report
    )


def test_export_warns_and_no_ema_exports_the_trained_weights(short_run, tmp_path, capsys, umask):
    run, _, _ = short_run
    assert cli.main(["export", str(run), "--out", str(tmp_path / "ema")]) == 0
    printed = capsys.readouterr()
    assert "(EMA weights after 0 update(s))" in printed.out
    assert "warning: the EMA received no update in 2 optimizer step(s)" in printed.err
    assert f"warning: the exported LoRA in {tmp_path / 'ema'} is empty" in printed.err

    assert cli.main(["export", str(run), "--out", str(tmp_path / "raw"), "--no-ema"]) == 0
    printed = capsys.readouterr()
    assert "(raw weights)" in printed.out and printed.err == ""
    assert any(torch.any(b) for b in up_projections(tmp_path / "raw"))
    for folder in (tmp_path / "ema", tmp_path / "raw"):
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()} == {
            name: oct(0o640)
            for name in ("adapter_config.json", "adapter_model.safetensors", "pytorch_lora_weights.safetensors")
        }


def test_an_ema_that_moved_or_a_run_without_one_gets_no_warning():
    assert weights.ema_warnings({"updates": 3, "optimizer_steps": 24, "max_abs_difference": 1e-3}, 8) == []
    assert weights.ema_warnings(None, 8) == []
    assert weights.ema_warnings({"updates": 0, "optimizer_steps": 0}, 8) == []  # nothing trained yet
    (same,) = weights.ema_warnings({"updates": 3, "optimizer_steps": 3, "max_abs_difference": 0.0}, 1)
    assert same.startswith("the EMA equals the raw trained weights exactly after 3 update(s)")
    # a checkpoint written before the summary existed: the updates follow from its optimizer steps
    old = {"optimizer_steps": 7, "recipe": {"train": {"ema_decay": 0.9, "ema_every": 8}}}
    assert weights.summary_of_checkpoint(old) == {"updates": 0, "optimizer_steps": 7}
    assert weights.summary_of_checkpoint({"optimizer_steps": 7, "recipe": {"train": {"ema_decay": 0.0}}}) is None


def test_peft_loads_every_export_with_the_outputs_of_load_lora_weights(short_run, tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from peft import PeftModel

    run, _, model = short_run
    export = tmp_path / "raw"
    assert cli.main(["export", str(run), "--out", str(export), "--no-ema"]) == 0
    assert (export / "adapter_config.json").is_file() and (export / "adapter_model.safetensors").is_file()

    diffusers_pipe = StableDiffusion3Pipeline.from_pretrained(str(model))
    diffusers_pipe.load_lora_weights(str(export))
    peft_model = PeftModel.from_pretrained(
        StableDiffusion3Pipeline.from_pretrained(str(model)).transformer, str(export)
    )
    base = StableDiffusion3Pipeline.from_pretrained(str(model)).transformer
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(2, 16, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, 5, 64, generator=g),
        "pooled_projections": torch.randn(2, 64, generator=g),
        "timestep": torch.tensor([800.0, 300.0]),
        "return_dict": False,
    }
    with torch.no_grad():
        by_diffusers = diffusers_pipe.transformer(**inputs)[0]
        by_peft = peft_model(**inputs)[0]
        by_base = base(**inputs)[0]
    assert torch.equal(by_peft, by_diffusers)
    assert (by_peft - by_base).abs().max() > 1e-4  # the adapter is there and does something


def test_the_log_file_holds_fgrpo_lines_and_no_progress_bar(short_run):
    _, log, _ = short_run
    assert "\r" not in log and "it/s]" not in log and "%|" not in log
    assert "Loading pipeline components" not in log and "Loading weights" not in log
    shapes = ("training ", "iter ", "eval at iteration ", "warning: ", "done: ", "report: ")
    assert [line for line in log.splitlines() if not line.startswith(shapes)] == []
    assert sum(line.startswith("iter ") for line in log.splitlines()) == ITERATIONS


def test_each_iteration_line_says_the_time_left_and_the_threads_it_was_measured_at(short_run):
    _, log, _ = short_run
    lines = [line for line in log.splitlines() if line.startswith("iter ")]
    # OMP_NUM_THREADS=1: the count is fixed at one; the last iteration has nothing left
    assert all(re.search(r"  eta \d+:\d\d at 1 thread$", line) for line in lines[:-1]), lines
    assert "eta" not in lines[-1]


def test_the_estimate_is_the_median_recent_pace_times_what_is_left():
    from fgrpo.core.runlog import eta_text

    assert eta_text([1.0, 9.0, 1.2, 1.1], 100, 2) == "1:55 at 2 threads"  # median 1.15 s, one slow outlier ignored
    assert eta_text([2.0] * 20, 3600, 1) == "2:00:00 at 1 thread"
    assert eta_text([], 10, 2) == "" and eta_text([1.0], 0, 2) == ""


def test_debug_gives_the_libraries_their_bars_back(monkeypatch):
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    for name in logs.LIBRARY_ENV:
        monkeypatch.delenv(name, raising=False)
    try:
        logs.configure("info")
        assert not diffusers_logging.is_progress_bar_enabled() and not transformers_logging.is_progress_bar_enabled()
        assert diffusers_logging.get_verbosity() == transformers_logging.get_verbosity() == 40  # errors only
        logs.configure("debug")
        assert diffusers_logging.is_progress_bar_enabled() and transformers_logging.is_progress_bar_enabled()
        assert diffusers_logging.get_verbosity() == 30
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the user's own setting wins
        logs.configure("debug")
        assert not diffusers_logging.is_progress_bar_enabled()
    finally:
        monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
        logs.configure(None)


def test_every_file_of_the_run_follows_the_umask(short_run):
    run, _, _ = short_run
    modes = {
        str(p.relative_to(run)): oct(p.stat().st_mode & 0o777)
        for p in run.rglob("*")
        if p.is_file() and not p.is_symlink()
    }
    assert any(name.endswith(".safetensors") for name in modes)
    assert {name: mode for name, mode in modes.items() if mode != oct(0o640)} == {}
