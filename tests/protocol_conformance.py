"""The built-in components, checked by mypy against the protocols they promise to satisfy.

Each table maps an entry-point name to its class under the protocol's ``type[...]``: mypy checks
every class's instances structurally against the protocol (attributes, method signatures). The
root pyproject lists this file in ``[tool.mypy] files``; ``test_protocol_conformance.py`` checks
that the tables name exactly the components the four fgrpo distributions register, so a new
built-in is checked as soon as it is registered.
"""

from __future__ import annotations

from fgrpo.core.objectives.grpo import GRPO
from fgrpo.core.objectives.guard import GRPOGuard
from fgrpo.core.prompts import FolderPrompts, ListPrompts, TextFilePrompts
from fgrpo.core.protocols import Kernel, Objective, Policy, PromptSource, Reward, Sampler
from fgrpo.models.flux import FluxPolicy
from fgrpo.models.flux2 import Flux2KleinPolicy, Flux2Policy
from fgrpo.models.hunyuan_video import HunyuanVideo15Policy
from fgrpo.models.qwen_image import QwenImagePolicy
from fgrpo.models.sd3 import SD3Policy
from fgrpo.models.shapes_dit import ShapesDiT
from fgrpo.models.vector import VectorPolicy
from fgrpo.models.wan import WanImageToVideoPolicy, WanPolicy
from fgrpo.models.z_image import ZImagePolicy
from fgrpo.rewards.aesthetic import Aesthetic
from fgrpo.rewards.clip import CLIPScore, PickScore
from fgrpo.rewards.geneval import GenEval
from fgrpo.rewards.hpsv2 import HPSv2
from fgrpo.rewards.imagereward import ImageReward
from fgrpo.rewards.jpeg import JpegCompressibility, JpegIncompressibility
from fgrpo.rewards.ocr import OCRReward
from fgrpo.rewards.remote import RemoteReward
from fgrpo.rewards.shapes.prompts import ShapesPrompts
from fgrpo.rewards.shapes.verifier import ShapesGold, ShapesVerifier
from fgrpo.rewards.target import TargetDistance
from fgrpo.rewards.vlm_judge import VLMJudge
from fgrpo.samplers.fast import FastSampler
from fgrpo.samplers.full import FullSampler
from fgrpo.samplers.kernels.cps import CPSKernel
from fgrpo.samplers.kernels.dance import DanceKernel
from fgrpo.samplers.kernels.dpmpp2m import DPMpp2MKernel
from fgrpo.samplers.kernels.dpmpp3m import DPMpp3MKernel
from fgrpo.samplers.kernels.ode import ODEKernel
from fgrpo.samplers.kernels.sde import SDEKernel
from fgrpo.samplers.kernels.wan_sde import WanSDEKernel
from fgrpo.samplers.mixgrpo import MixGRPOSampler

KERNELS: dict[str, type[Kernel]] = {
    "ode": ODEKernel,
    "sde": SDEKernel,
    "dance": DanceKernel,
    "cps": CPSKernel,
    "dpmpp2m": DPMpp2MKernel,
    "dpmpp3m": DPMpp3MKernel,
    "wan-sde": WanSDEKernel,
}
SAMPLERS: dict[str, type[Sampler]] = {"full": FullSampler, "fast": FastSampler, "mixgrpo": MixGRPOSampler}
REWARDS: dict[str, type[Reward]] = {
    "jpeg-compressibility": JpegCompressibility,
    "jpeg-incompressibility": JpegIncompressibility,
    "target-distance": TargetDistance,
    "ocr": OCRReward,
    "clip-score": CLIPScore,
    "pickscore": PickScore,
    "aesthetic": Aesthetic,
    "hpsv2": HPSv2,
    "imagereward": ImageReward,
    "geneval": GenEval,
    "vlm-judge": VLMJudge,
    "remote": RemoteReward,
    "shapes": ShapesVerifier,
    "shapes-gold": ShapesGold,
}
MODELS: dict[str, type[Policy]] = {
    "vector": VectorPolicy,
    "sd3": SD3Policy,
    "flux": FluxPolicy,
    "flux2": Flux2Policy,
    "flux2-klein": Flux2KleinPolicy,
    "z-image": ZImagePolicy,
    "qwen-image": QwenImagePolicy,
    "wan": WanPolicy,
    "wan-i2v": WanImageToVideoPolicy,
    "hunyuan-video-1.5": HunyuanVideo15Policy,
    "shapes-dit": ShapesDiT,
}
OBJECTIVES: dict[str, type[Objective]] = {"grpo": GRPO, "grpo-guard": GRPOGuard}
PROMPTS: dict[str, type[PromptSource]] = {
    "text-file": TextFilePrompts,
    "list": ListPrompts,
    "folder": FolderPrompts,
    "shapes": ShapesPrompts,
}

#: registry kind -> its table
BY_KIND: dict[str, dict[str, type]] = {
    "kernel": KERNELS,
    "sampler": SAMPLERS,
    "reward": REWARDS,
    "model": MODELS,
    "objective": OBJECTIVES,
    "prompts": PROMPTS,
}
