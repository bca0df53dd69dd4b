"""What the docs state about the built-in components agrees with the entry points: a count of
built-in components of a kind anywhere in the docs, the READMEs or a docstring is the registry's."""

from __future__ import annotations

import re
from collections import Counter

from fgrpo.core import shipped

WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
KINDS = {
    "kernels": "kernel",
    "samplers": "sampler",
    "rewards": "reward",
    "models": "model",
    "objectives": "objective",
    "prompt sources": "prompts",
    "evaluators": "evaluator",
}
COUNT = re.compile(r"\b(\d+|" + "|".join(WORDS) + r") built-in (" + "|".join(KINDS) + r")\b", re.IGNORECASE)
BACKBONES = re.compile(r"\b(\d+|" + "|".join(WORDS) + r")(?: of them)? diffusers backbones\b", re.IGNORECASE)


def _number(text: str) -> int:
    return int(text) if text.isdigit() else WORDS[text.lower()]


def _texts(root):
    paths = [root / "README.md", *(root / "docs").glob("*.md"), *root.glob("packages/*/README.md")]
    paths += list(root.glob("packages/*/src/fgrpo/**/*.py"))
    return {str(p.relative_to(root)): p.read_text() for p in paths}


def test_stated_counts_of_built_in_components_are_the_registrys(root):
    per_kind = Counter(kind for kind, _ in shipped.COMPONENTS)
    backbones = sum(
        1
        for (kind, _), (dist, extras) in shipped.COMPONENTS.items()
        if kind == "model" and dist == "fgrpo-models" and "diffusers" in extras
    )
    stated, wrong = 0, []
    for where, text in _texts(root).items():
        flat = " ".join(text.split())  # a figure may be wrapped onto the next line
        for number, kind in COUNT.findall(flat):
            stated += 1
            registered = per_kind[KINDS[kind.lower()]]
            if _number(number) != registered:
                wrong.append(f"{where}: {number} built-in {kind}; the entry points have {registered}")
        for number in BACKBONES.findall(flat):
            stated += 1
            if _number(number) != backbones:
                wrong.append(f"{where}: {number} diffusers backbones; the entry points have {backbones}")
    assert wrong == []
    assert stated >= 8  # docs/architecture.md states every kind's count


def test_the_check_sees_a_wrong_count(root, tmp_path):
    """The same check on a doc that states one kernel too many."""
    kernels = Counter(kind for kind, _ in shipped.COMPONENTS)["kernel"]
    text = f"fgrpo ships {kernels + 1} built-in kernels"
    [(number, kind)] = COUNT.findall(text)
    assert _number(number) != kernels and KINDS[kind] == "kernel"
