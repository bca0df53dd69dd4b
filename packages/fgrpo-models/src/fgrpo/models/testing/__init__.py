"""Testing helpers for diffusers backbones: tiny random pipelines built offline and the
conformance base every backbone's tests subclass.

- :class:`DiffusersBackboneConformance` (:mod:`fgrpo.models.testing.conformance`), a
  :class:`fgrpo.core.testing.PolicyConformance` with the diffusers-specific checks;
  :class:`EditingBackboneConformance`, the same for editing backbones with ``fgrpo check``;
- ``build_tiny_<kind>_pipeline`` for every backbone (``build_tiny_sd3_pipeline``,
  ``build_tiny_wan22_pipeline``, ...): :mod:`fgrpo.models.testing.pipelines`, one module per
  backbone family.

Exports are lazy: importing this package imports neither diffusers nor pytest.
"""

from __future__ import annotations

import importlib

try:  # detailed assertion messages inside the conformance base, for plugin authors' tests
    import pytest

    pytest.register_assert_rewrite("fgrpo.models.testing.conformance")
except ImportError:  # pytest is only needed to run the base
    pass

_EXPORTS = {
    "DiffusersBackboneConformance": "fgrpo.models.testing.conformance",
    "EditingBackboneConformance": "fgrpo.models.testing.conformance",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name.startswith(("build_tiny_", "tiny_")):  # a tiny pipeline's builder or tokenizer, per backbone module
        return getattr(importlib.import_module("fgrpo.models.testing.pipelines"), name)
    raise AttributeError(name)
