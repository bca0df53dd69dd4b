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
    with pytest.raises(
        registry.PluginImportError,
        match=r"reward 'broken' from fgrpo-broken failed to import: RuntimeError: boom at import",
    ):
        registry.load("reward", "broken")
    state, detail = registry.status(registry.entry("reward", "broken"))
    assert state == "import error" and "boom at import" in detail
    reward = registry.create("reward", "brightness")
    assert type(reward).__name__ == "Brightness"


def test_missing_extra_names_the_install_line(third_party):
    with pytest.raises(registry.MissingExtra) as info:
        registry.load("reward", "needy")
    assert str(info.value) == "reward 'needy' needs fgrpo-no-such-package: pip install \"fgrpo-broken[fancy]\""


def test_unknown_name_lists_available_and_closest():
    with pytest.raises(registry.UnknownComponent) as info:
        registry.load("kernel", "sdee")
    message = str(info.value)
    assert "did you mean 'sde'?" in message
    for name in ("cps", "dance", "dpmpp2m", "euler", "sde"):
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
    builtins = (
        {("kernel", n) for n in ("euler", "sde", "wan-sde", "dance", "cps", "dpmpp2m", "dpmpp3m")}
        | {("sampler", n) for n in ("full", "fast", "mixgrpo")}
        | {("objective", "grpo"), ("objective", "grpo-guard"), ("model", "vector"), ("prompts", "list")}
    )
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


@pytest.fixture
def exiting(tmp_path):
    """A distribution whose reward module and hook plugin call sys.exit() when imported, and one
    that registers a reward name the example plugin already registers."""
    (tmp_path / "exiting_reward.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "exiting_hooks.py").write_text("import sys\nsys.exit('bye')\n")
    (tmp_path / "rival_reward.py").write_text("class Brightness:\n    pass\n")
    for name, entry_points in (
        (
            "fgrpo_exiting",
            "[fgrpo.rewards]\nexiting = exiting_reward:Exiting\n[fgrpo.plugins]\nexiting-hooks = exiting_hooks\n",
        ),
        ("fgrpo_rival", "[fgrpo.rewards]\nbrightness = rival_reward:Brightness\n"),
    ):
        info = tmp_path / f"{name}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(entry_points)
    return tmp_path


def test_a_plugin_that_exits_at_import_is_isolated(exiting, monkeypatch, capsys):
    from fgrpo.core import cli, hookspecs

    monkeypatch.syspath_prepend(str(exiting))
    monkeypatch.setattr(registry, "_loaded", {})
    monkeypatch.setattr(hookspecs, "_manager", None)  # this test's own plugin manager
    monkeypatch.setattr(hookspecs, "_failures", [])
    with pytest.raises(SystemExit) as helped:  # before: exit 3 and no output, for every command
        cli.main(["--help"])
    assert helped.value.code == 0 and "compose" in capsys.readouterr().out
    assert cli.main(["plugins", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    rows = {(r["kind"], r["name"], r["distribution"]): r for r in found["components"]}
    exiting_row = rows[("reward", "exiting", "fgrpo-exiting")]
    assert exiting_row["status"] == "import error" and "SystemExit: 3" in exiting_row["error"]
    hooks = {h["name"]: h for h in found["hook_plugins"]}
    assert hooks["exiting-hooks"]["status"] == "import error" and "SystemExit: bye" in hooks["exiting-hooks"]["error"]
    # before: the first distribution found silently won; now both rows say so
    for dist in ("fgrpo-reward-example", "fgrpo-rival"):
        row = rows[("reward", "brightness", dist)]
        assert row["status"] == "conflict"
        assert "reward 'brightness' is registered by fgrpo-reward-example and fgrpo-rival" in row["error"]


def test_a_name_two_distributions_register_is_refused_in_a_recipe(exiting, monkeypatch, root, capsys):
    from fgrpo.core import cli

    monkeypatch.syspath_prepend(str(exiting))
    monkeypatch.setattr(registry, "_loaded", {})
    code = cli.main(
        ["validate", str(root / "recipes" / "vector.yaml"), "--set", "reward={name: brightness, target: 0.5}"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert (
        "reward.name: reward 'brightness' is registered by fgrpo-reward-example and fgrpo-rival; fgrpo will not pick "
        "one" in err
    )
