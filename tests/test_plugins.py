"""The registry and `fgrpo plugins`: built-ins and third-party plugins alike; a broken plugin is
reported while every other component keeps working."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from _helpers import run_fgrpo
from fgrpo.core import registry
from fgrpo.core.config import RecipeError


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """A fake installed distribution with a module that raises on import and an unmet extra."""
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "needy_plugin.py").write_text("class Needy:\n    pass\n")
    info = tmp_path / "fgrpo_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fgrpo-broken\nVersion: 0.1\nProvides-Extra: fancy\n"
        'Requires-Dist: fgrpo-no-such-package ; extra == "fancy"\n'
    )
    (info / "entry_points.txt").write_text(
        textwrap.dedent(
            """
            [fgrpo.rewards]
            broken = broken_plugin:Broken
            needy = needy_plugin:Needy [fancy]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry._loaded.clear()
    yield tmp_path
    registry._loaded.clear()
    sys.modules.pop("broken_plugin", None)


def test_listing_imports_no_component(third_party):
    assert {"broken", "needy", "brightness", "target-distance"} <= set(registry.names("reward"))
    assert "broken_plugin" not in sys.modules


def test_broken_plugin_is_reported_and_others_work(third_party):
    with pytest.raises(registry.PluginImportError, match=r"reward 'broken' from fgrpo-broken failed to import: RuntimeError: boom at import"):
        registry.load("reward", "broken")
    state, detail = registry.status(registry.entry("reward", "broken"))
    assert state == "import error" and "boom at import" in detail
    reward = registry.create("reward", "brightness")
    assert type(reward).__name__ == "Brightness"


def test_missing_extra_names_the_install_line(third_party):
    with pytest.raises(registry.MissingExtra) as info:
        registry.load("reward", "needy")
    assert str(info.value) == 'reward \'needy\' needs fgrpo-no-such-package: pip install "fgrpo-broken[fancy]"'


def test_unknown_name_lists_available_and_closest():
    with pytest.raises(registry.UnknownComponent) as info:
        registry.load("kernel", "sdee")
    message = str(info.value)
    assert "did you mean 'sde'?" in message
    for name in ("cps", "dance", "dpmpp2m", "ode", "sde"):
        assert name in message


def test_create_validates_before_building():
    with pytest.raises(RecipeError) as info:
        registry.create("kernel", "sde", eta=-1.0, wobble=2)
    text = str(info.value)
    assert "kernel.eta: got -1.0; allowed: >= 0" in text
    assert "kernel.wobble: unknown key" in text


def test_plugins_json_lists_builtins_example_and_broken(third_party):
    result = run_fgrpo("plugins", "--json", env={"PYTHONPATH": str(third_party)})
    assert result.returncode == 0, result.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(result.stdout)["components"]}
    builtins = {
        ("kernel", n) for n in ("ode", "sde", "dance", "cps", "dpmpp2m", "dpmpp3m")
    } | {("sampler", n) for n in ("full", "fast", "mixgrpo")} | {
        ("objective", "grpo"), ("objective", "grpo-guard"), ("model", "vector"), ("prompts", "list")
    }
    for key in builtins:
        assert rows[key]["status"] == "ok", rows[key]
        assert rows[key]["distribution"].startswith("fgrpo-")
    example = rows[("reward", "brightness")]
    assert (example["distribution"], example["version"], example["status"]) == ("fgrpo-reward-example", "0.1.0", "ok")
    assert example["target"] == "fgrpo_reward_example:Brightness"
    assert rows[("reward", "broken")]["status"] == "import error"
    assert "boom at import" in rows[("reward", "broken")]["error"]
    assert rows[("reward", "needy")]["status"] == "missing extra"


def test_example_plugin_usable_in_a_recipe(root, capsys):
    from fgrpo.core import cli

    recipe = str(root / "recipes" / "vector.yaml")
    code = cli.main(["validate", recipe, "--set", "reward={name: brightness, target: 0.5}"])
    assert code == 0, capsys.readouterr().err
