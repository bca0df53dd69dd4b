"""The installs work as written: each package README lists every component and extra its
pyproject.toml declares, its install lines name every local package pip needs (fgrpo is not on
PyPI), a fresh venv installs the rewards package exactly as its README says (slow), and the core
wheel carries every shipped recipe, accelerate config and benchmark recipe without setuptools'
"would be ignored" warning."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from fgrpo.core import shipped

PACKAGES = list(shipped.DISTRIBUTIONS)


def pyproject(root: Path, package: str) -> dict:
    return tomllib.loads((root / "packages" / package / "pyproject.toml").read_text())


def readme(root: Path, package: str) -> str:
    return (root / "packages" / package / "README.md").read_text()


@pytest.mark.parametrize("package", PACKAGES)
def test_each_readme_lists_every_component_and_extra(root, package):
    meta, text = pyproject(root, package), readme(root, package)
    named = set(re.findall(r"`([\w.-]+)`", text))
    components = {
        name
        for group, eps in meta["project"].get("entry-points", {}).items()
        for name in eps
        if group != "fgrpo.plugins"
    }
    assert sorted(components - named) == []
    commands = {f"fgrpo {name}" for name in meta["project"].get("entry-points", {}).get("fgrpo.plugins", {})}
    assert all(c in text for c in commands), commands
    extras = set(meta["project"].get("optional-dependencies", {}))
    assert sorted(e for e in extras if f"[{e}]" not in text) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_the_repository_readme_names_them_too(root, package):
    """The README's table of the parts: the package's row names every component and extra."""
    meta = pyproject(root, package)
    (row,) = [line for line in (root / "README.md").read_text().splitlines() if line.startswith(f"| `{package}` |")]
    named = set(re.findall(r"`([\w.-]+)`", row))
    components = {
        n for group, eps in meta["project"].get("entry-points", {}).items() if group != "fgrpo.plugins" for n in eps
    }
    assert sorted(components - named) == []
    assert sorted(e for e in meta["project"].get("optional-dependencies", {}) if f"[{e}]" not in row) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_install_lines_name_the_local_packages_pip_needs(root, package):
    """Every pip line of a package README installs from a checkout, fgrpo-core named in it
    (pip cannot find a local dependency it was not given)."""
    lines = [line.split("#")[0].strip() for line in re.findall(r"^\s*(pip install .*)$", readme(root, package), re.M)]
    lines = [line for line in lines if line != "pip install torch"]
    assert lines
    for line in lines:
        assert "./packages/fgrpo-core" in line and f"./packages/{package}" in line, line
        words = [w.strip('"') for w in line.split()[2:]]
        assert all(w.startswith("./packages/") for w in words), line  # nothing looked up on an index


def test_the_wheel_ships_every_recipe_config_and_bench_file(root):
    data = pyproject(root, "fgrpo-core")["tool"]["setuptools"]["package-data"]
    shipped_files = [p for p in (root / "recipes").rglob("*") if p.is_file() and p.suffix in (".yaml", ".md")]
    assert any(p.parent.name == "accelerate" for p in shipped_files) and any(
        p.parent.name == "bench" for p in shipped_files
    )
    for path in shipped_files:
        relative = path.relative_to(root / "recipes")
        package = ".".join(["fgrpo.core.recipes", *relative.parent.parts])
        if relative.parent.parts or path.suffix == ".yaml":
            assert any(fnmatch.fnmatch(path.name, pattern) for pattern in data.get(package, [])), relative
    assert "exclude" not in pyproject(root, "fgrpo-core")["tool"]["setuptools"]["packages"]["find"]


def test_launch_finds_the_shipped_accelerate_configs_by_name(tmp_path, monkeypatch):
    configs = shipped.accelerate_configs()
    assert sorted(configs) == [
        "cpu",
        "ddp",
        "deepspeed-zero2",
        "deepspeed-zero2-offload",
        "deepspeed-zero3",
        "deepspeed-zero3-offload",
        "fsdp-full",
        "fsdp-lora",
        "multi-node",
    ]
    monkeypatch.chdir(tmp_path)
    assert shipped.with_shipped_configs(["--config_file", "ddp", "--num_processes", "2"]) == [
        "--config_file",
        str(configs["ddp"]),
        "--num_processes",
        "2",
    ]
    assert shipped.with_shipped_configs(["--config_file=fsdp-lora.yaml"]) == [f"--config_file={configs['fsdp-lora']}"]
    (tmp_path / "ddp").write_text("mine")
    assert shipped.with_shipped_configs(["--config_file", "ddp"]) == [
        "--config_file",
        "ddp",
    ]  # a file of that name wins


def install_block(text: str, marker: str) -> list[str]:
    block = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_a_fresh_venv_installs_the_rewards_package_as_its_readme_says(root, tmp_path):
    """A checkout copied elsewhere (builds write into the source tree), a new venv, the README's
    commands as written (its `pip install torch` is the local CPU wheel's pin here: a bare torch
    would pull a CUDA build): the ocr reward is installed and scores offline. Also shows that
    the old line, the rewards package alone, cannot resolve fgrpo-core, and that the core wheel
    builds without setuptools' warning and carries the accelerate configs. A few minutes."""
    checkout = tmp_path / "fgrpo"
    skip = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests", ".venv")
    shutil.copytree(root / "packages", checkout / "packages", symlinks=True, ignore=skip)
    shutil.copytree(root / "recipes", checkout / "recipes")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {
        **os.environ,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
    }
    env.pop("PYTHONPATH", None)

    def sh(line: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            line, shell=True, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800, **kwargs
        )

    alone = sh('pip install "./packages/fgrpo-rewards[ocr]"')
    assert alone.returncode != 0 and "No matching distribution found for fgrpo-core" in alone.stderr + alone.stdout

    for line in install_block(readme(root, "fgrpo-rewards"), "install:rewards"):
        done = sh("pip install torch==2.13.0" if line == "pip install torch" else line)
        assert done.returncode == 0, (line, done.stderr[-3000:])
    plugins = json.loads(sh("fgrpo plugins --json").stdout)
    status = {row["name"]: row["status"] for row in plugins["components"] if row["kind"] == "reward"}
    assert status["ocr"] == "ok" and status["jpeg-compressibility"] == "ok" and status["clip-score"] == "missing extra"
    assert "shapes" not in status  # the worlds are fgrpo-worlds'
    scored = sh(f'{venv / "bin" / "python"} -c "{OCR_SCORE}"')
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert float(scored.stdout.split()[-1]) > 0.5

    wheel = sh(f"pip wheel -v --no-deps --no-build-isolation -w {tmp_path / 'dist'} ./packages/fgrpo-core")
    assert wheel.returncode == 0 and "would be ignored" not in wheel.stdout + wheel.stderr
    names = subprocess.run(
        [sys.executable, "-m", "zipfile", "-l", str(next((tmp_path / "dist").glob("fgrpo_core-*.whl")))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "fgrpo/core/recipes/accelerate/ddp.yaml" in names and "fgrpo/core/recipes/bench/tiny_sd3_jpeg.yaml" in names


OCR_SCORE = (
    "import torch, numpy as np; from PIL import Image, ImageDraw, ImageFont; "
    "from fgrpo.core import registry; "
    "im = Image.new('RGB', (256, 96), 'white'); d = ImageDraw.Draw(im); "
    "d.text((20, 25), 'HELLO', fill='black', font=ImageFont.load_default(size=40)); "
    "x = torch.from_numpy(np.asarray(im)).permute(2, 0, 1)[None].float() / 255; "
    "r = registry.create('reward', 'ocr'); print(r(x, ['a sign that says \\\"HELLO\\\"'], [{}]).scores.item())"
)
