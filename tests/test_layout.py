"""fgrpo is a PEP 420 namespace shared by four distributions: no fgrpo/__init__.py anywhere."""

from __future__ import annotations

import fgrpo


def test_no_namespace_init_file(root):
    offenders = [p for p in root.glob("packages/*/src/fgrpo/__init__.py")]
    assert offenders == []
    assert sorted(p.parent.parent.name for p in root.glob("packages/*/src/fgrpo")) == [
        "fgrpo-core",
        "fgrpo-models",
        "fgrpo-rewards",
        "fgrpo-samplers",
    ]


def test_namespace_spans_all_packages():
    assert getattr(fgrpo, "__file__", None) is None
    parts = sorted(p.split("/")[-3] for p in fgrpo.__path__)
    assert parts == ["fgrpo-core", "fgrpo-models", "fgrpo-rewards", "fgrpo-samplers"]
