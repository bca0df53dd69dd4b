"""The four distributions stand on their own: versions, licenses, standalone descriptions, the
built-in recipes as package data, and hints that name the package to install."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from _helpers import run_fgrpo
from fgrpo.core import registry, shipped

PACKAGES = list(shipped.DISTRIBUTIONS)


def pyproject(root: Path, package: str) -> dict:
    return tomllib.loads((root / "packages" / package / "pyproject.toml").read_text())


def test_version_names_all_four_distributions():
    result = run_fgrpo("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"{name} {md.version(name)}" for name in PACKAGES]


@pytest.mark.parametrize("package", PACKAGES)
def test_license_and_standalone_description(root, package):
    folder = root / "packages" / package
    assert (folder / "LICENSE").read_text() == (root / "LICENSE").read_text()
    assert "Apache License" in (root / "LICENSE").read_text() and "Version 2.0" in (root / "LICENSE").read_text()
    meta = pyproject(root, package)
    assert meta["project"]["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert meta["project"]["license-files"] == ["LICENSE"]
    assert meta["build-system"]["requires"] == ["setuptools>=77"]  # the first with PEP 639 licenses
    readme = (folder / meta["project"]["readme"]).read_text()
    links = re.findall(r"\]\(([^)]+)\)", readme)
    assert [link for link in links if not link.startswith(("https://", "http://", "#"))] == []
    assert len(readme.split()) > 100  # describes the package on PyPI without the repository
    assert package in readme.splitlines()[0]


def test_shipped_recipes_are_the_repository_recipes(root):
    """fgrpo/core/recipes links to recipes/: one set of files, built into wheels as package data."""
    assert shipped.recipes_folder().resolve() == (root / "recipes").resolve()
    assert shipped.recipe_names() == sorted(p.stem for p in (root / "recipes").glob("*.yaml"))
    assert "fgrpo.core.recipes" in pyproject(root, "fgrpo-core")["tool"]["setuptools"]["package-data"]


def test_builtin_recipe_by_name_from_anywhere(tmp_path, monkeypatch, capsys):
    from fgrpo.core import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["validate", "shapes"]) == 0
    assert "shapes: ok" in capsys.readouterr().out
    assert cli.main(["validate", "shapez"]) == 2
    err = capsys.readouterr().err
    assert (
        "shapez: no such recipe file, and no built-in recipe of that name (did you mean 'shapes'?); built-in recipes: "
        in err
    )
    assert "fgrpo recipes lists each" in err
    assert "shapes-fast" in err


def test_builtin_component_table_is_generated_from_the_pyprojects(root):
    """fgrpo.core.builtin_components lists every component the packages' entry points declare, with
    its distribution and extras (z-image, flux2 and image-similarity were missing from the
    hand-written list it replaced)."""
    from _helpers import load_tool

    tables = load_tool("protocol_tables.py")
    generated = tables.render_components(root)
    written = (root / "packages/fgrpo-core/src/fgrpo/core/builtin_components.py").read_text()
    assert written == generated, "builtin_components.py lags behind the entry points: python tools/protocol_tables.py"
    declared = tables.declared_components(root)
    assert declared == shipped.COMPONENTS
    for key in [("model", "z-image"), ("model", "flux2"), ("reward", "image-similarity"), ("model", "shapes-dit")]:
        assert key in shipped.COMPONENTS, key
    assert shipped.COMPONENTS[("model", "shapes-dit")] == ("fgrpo-worlds", ("diffusers",))
    assert {k: shipped.kind_provider(k) for k in registry.GROUPS} == {
        "kernel": "fgrpo-samplers",
        "sampler": "fgrpo-samplers",
        "reward": "fgrpo-rewards",
        "model": "fgrpo-models",
        "objective": None,
        "prompts": "fgrpo-worlds",
        "evaluator": "fgrpo-worlds",
    }


def _without(monkeypatch, distribution: str) -> None:
    """Pretend ``distribution`` is not installed: no version, none of its entry points."""
    real_version, real_eps = shipped.version, registry._entry_points
    monkeypatch.setattr(shipped, "version", lambda d: None if d == distribution else real_version(d))
    monkeypatch.setattr(
        registry,
        "_entry_points",
        lambda kind: {
            n: ep for n, ep in real_eps(kind).items() if ep.dist is None or ep.dist.metadata["Name"] != distribution
        },
    )
    monkeypatch.setattr(registry, "_loaded", {})


def test_unknown_component_of_an_absent_builtin_package_names_it(monkeypatch, root, capsys):
    _without(monkeypatch, "fgrpo-models")
    with pytest.raises(registry.UnknownComponent) as info:
        registry.entry("model", "vector")
    assert str(info.value) == (
        "unknown model 'vector': it comes with fgrpo-models, which is not installed: pip install fgrpo-models; "
        "available: shapes-dit, shapes-edit-dit, trajectory"
    )
    with pytest.raises(
        registry.UnknownComponent,
        match=r"the built-in models come with fgrpo-models, which is not installed: pip install fgrpo-models",
    ):
        registry.entry("model", "my-own-model")
    from fgrpo.core import cli

    assert cli.main(["validate", str(root / "recipes" / "vector.yaml")]) == 2
    err = capsys.readouterr().err
    assert "model.name: unknown model 'vector': it comes with fgrpo-models, which is not installed: " in err
    assert "sampler" not in err  # only the model is missing


def test_a_world_component_of_an_absent_fgrpo_worlds_names_it(monkeypatch, root, capsys):
    _without(monkeypatch, "fgrpo-worlds")
    from fgrpo.core import cli

    assert cli.main(["validate", str(root / "recipes" / "shapes.yaml")]) == 2
    err = capsys.readouterr().err
    assert "model.name: unknown model 'shapes-dit': it comes with fgrpo-worlds, which is not installed: " in err
    assert 'pip install "fgrpo-worlds[diffusers]"' in err
    assert "reward.name: unknown reward 'shapes': it comes with fgrpo-worlds, which is not installed" in err
    assert "prompts.name: unknown prompts 'shapes': it comes with fgrpo-worlds, which is not installed" in err


def test_unknown_component_with_its_package_installed_keeps_the_close_match():
    with pytest.raises(registry.UnknownComponent, match=r"unknown model 'vectr' \(did you mean 'vector'\?\)"):
        registry.entry("model", "vectr")


@pytest.mark.slow
def test_builtin_recipe_after_a_non_editable_install(root, tmp_path):
    """A user's install: the five packages built and installed (not editable) into a fresh venv,
    used from a folder without the repository. Several minutes (it builds and installs wheels)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run(pip + ["torch==2.13.0"], check=True, env=env)  # a bare torch would pull a CUDA build
    # build from a copy: setuptools builds in the source tree (build/), and the copy keeps the
    # relative link fgrpo/core/recipes -> recipes/ that puts the recipes into the wheel
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests")
    shutil.copytree(root / "packages", src / "packages", symlinks=True, ignore=skip)
    shutil.copytree(root / "recipes", src / "recipes")
    packages = [str(src / "packages" / p) for p in PACKAGES[:3]] + [
        str(src / "packages" / "fgrpo-models") + "[diffusers]",
        str(src / "packages" / "fgrpo-worlds") + "[diffusers]",
    ]
    subprocess.run(pip + packages, check=True, env=env)
    work = tmp_path / "elsewhere"
    work.mkdir()
    fgrpo = str(venv / "bin" / "fgrpo")
    run_env = {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([fgrpo, *args], cwd=work, env=run_env, capture_output=True, text=True, timeout=900)

    version = run("--version")
    assert version.stdout.split() == [w for p in PACKAGES for w in (p, "0.1.0")], version.stdout
    location = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import fgrpo.core, sys; print(fgrpo.core.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(venv) in location and str(root) not in location  # not the repository's sources
    assert run("validate", "shapes").returncode == 0
    composed = run(
        "compose",
        "shapes",
        "--out",
        "run",
        "--quiet",
        "--set",
        "train.iterations=1",
        "--set",
        "train.prompts_per_iteration=2",
        "--set",
        "eval.every=1",
        "--set",
        "eval.max_prompts=4",
    )
    assert composed.returncode == 0, composed.stderr
    assert (work / "run" / "report.html").is_file()
    assert composed.stdout.strip().splitlines()[-1] == "report: run/report.html"
    assert composed.stderr == ""  # quiet: no import-time warnings a user cannot act on
