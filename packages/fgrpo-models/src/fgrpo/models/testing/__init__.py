"""Testing helpers for diffusers backbones: tiny random pipelines built offline and the
conformance base every backbone's tests subclass.

- :class:`DiffusersBackboneConformance` (:mod:`fgrpo.models.testing.conformance`), a
  :class:`fgrpo.core.testing.PolicyConformance` with the diffusers-specific checks;
  :class:`EditingBackboneConformance`, the same for editing backbones with ``fgrpo check``;
- ``build_tiny_sd3_pipeline``, ``build_tiny_flux_pipeline``, ``build_tiny_flux_kontext_pipeline``,
  ``build_tiny_flux2_pipeline``, ``build_tiny_flux2_klein_pipeline``, ``build_tiny_qwen_image_pipeline``,
  ``build_tiny_qwen_image_edit_pipeline``, ``build_tiny_z_image_pipeline``, ``build_tiny_wan_pipeline``,
  ``build_tiny_wan22_pipeline``, ``build_tiny_wan22_i2v_pipeline``, ``build_tiny_wan22_ti2v_pipeline``,
  ``build_tiny_hunyuan_video15_pipeline`` (:mod:`fgrpo.models.testing.pipelines`).

Exports are lazy: importing this package imports neither diffusers nor pytest.
"""

from __future__ import annotations

import importlib

try:  # detailed assertion messages inside the conformance base, for plugin authors' tests
    import pytest

    pytest.register_assert_rewrite("fgrpo.models.testing.conformance")
except ImportError:  # pytest is only needed to run the base
    pass

_PIPELINES = "fgrpo.models.testing.pipelines"
_EXPORTS = {
    "DiffusersBackboneConformance": "fgrpo.models.testing.conformance",
    "EditingBackboneConformance": "fgrpo.models.testing.conformance",
    "build_tiny_flux2_klein_pipeline": _PIPELINES,
    "build_tiny_flux2_pipeline": _PIPELINES,
    "build_tiny_flux_kontext_pipeline": _PIPELINES,
    "build_tiny_flux_pipeline": _PIPELINES,
    "build_tiny_hunyuan_video15_pipeline": _PIPELINES,
    "build_tiny_qwen_image_edit_pipeline": _PIPELINES,
    "build_tiny_qwen_image_pipeline": _PIPELINES,
    "build_tiny_sd3_pipeline": _PIPELINES,
    "build_tiny_wan22_i2v_pipeline": _PIPELINES,
    "build_tiny_wan22_pipeline": _PIPELINES,
    "build_tiny_wan22_ti2v_pipeline": _PIPELINES,
    "build_tiny_wan_pipeline": _PIPELINES,
    "build_tiny_z_image_pipeline": _PIPELINES,
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
