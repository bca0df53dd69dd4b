"""Tiny random diffusers pipelines built offline, for tests, tools and plugin authors.

Nothing is downloaded: tokenizers are built from in-memory vocabularies and every network is a
freshly initialised miniature of the real architecture, with the real configurations where they
matter (schedulers, VAE latent normalisation, the Qwen-Image prompt template's token count). Each
builder returns a real pipeline that runs ``pipe(...)``, and saves it with ``save_pretrained`` when
given a path, so a test loads it through the same ``from_pretrained`` path users take. One module
per backbone family (a new backbone adds its own: nothing here lists them):

- :mod:`.sd3` ``build_tiny_sd3_pipeline`` -> ``StableDiffusion3Pipeline`` (CLIP x2 + T5, SD3 transformer)
- :mod:`.flux` ``build_tiny_flux_pipeline`` -> ``FluxPipeline``; ``build_tiny_flux_kontext_pipeline``
  -> ``FluxKontextPipeline`` (FLUX's networks, a source image)
- :mod:`.qwen_image` ``build_tiny_qwen_image_pipeline`` -> ``QwenImagePipeline`` (Qwen2.5-VL);
  ``build_tiny_qwen_image_edit_pipeline`` -> ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline``
- :mod:`.wan` ``build_tiny_wan_pipeline`` -> ``WanPipeline`` (UMT5, Wan 2.1); ``build_tiny_wan22_pipeline``,
  ``build_tiny_wan22_i2v_pipeline``, ``build_tiny_wan22_ti2v_pipeline`` -> Wan 2.2 T2V-A14B (two
  experts), I2V-A14B, TI2V-5B
- :mod:`.flux2` ``build_tiny_flux2_pipeline``, ``build_tiny_flux2_klein_pipeline`` -> FLUX.2 [dev] / [klein]
- :mod:`.z_image` ``build_tiny_z_image_pipeline`` -> ``ZImagePipeline`` (Qwen3)
- :mod:`.hunyuan_video` ``build_tiny_hunyuan_video15_pipeline`` -> ``HunyuanVideo15Pipeline`` (Qwen2.5-VL + ByT5)

About 1-3 MB each; 64x64 outputs by default (Wan: 5 frames of 32x32). Every public name of these
modules is also an attribute of this package (found on first use); diffusers and transformers are
imported inside the builders, so importing this package is cheap.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any


def modules() -> list[str]:
    """The backbone modules of this package (``sd3``, ``flux``, ...)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def builders() -> dict[str, Callable[..., Any]]:
    """Every ``build_tiny_<kind>_pipeline`` by its kind (``sd3``, ``wan22_i2v``, ...)."""
    found = {}
    for name in modules():
        module = importlib.import_module(f"{__name__}.{name}")
        for attr, value in vars(module).items():
            if attr.startswith("build_tiny_") and attr.endswith("_pipeline") and callable(value):
                found[attr.removeprefix("build_tiny_").removesuffix("_pipeline")] = value
    return dict(sorted(found.items()))


def __getattr__(name: str) -> Any:
    if not name.startswith("__"):
        for module_name in ["_common", *modules()]:
            module = importlib.import_module(f"{__name__}.{module_name}")
            if name in vars(module) or name in getattr(module, "LAZY", ()):
                return getattr(module, name)
    raise AttributeError(name)
