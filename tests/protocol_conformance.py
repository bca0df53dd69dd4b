"""The built-in components, checked by mypy against the protocols they promise to satisfy.

Each table maps an entry-point name to its class under the protocol's ``type[...]``: mypy checks
every class's instances structurally against the protocol (attributes, method signatures). The
root pyproject lists this file in ``[tool.mypy] files``; ``test_protocol_conformance.py`` checks
that the tables name exactly the components the four fgrpo distributions register. Written by
``python tools/protocol_tables.py``: run it after adding or removing a built-in component.
"""

from __future__ import annotations

from fgrpo.core.objectives.awm import AWM
from fgrpo.core.objectives.dgpo import DGPO
from fgrpo.core.objectives.dpo import DPO
from fgrpo.core.objectives.flow_dppo import FlowDPPO
from fgrpo.core.objectives.grpo import GRPO
from fgrpo.core.objectives.grpo_guard import GRPOGuard
from fgrpo.core.objectives.nft import NFT
from fgrpo.core.prompts import FolderPrompts, ListPrompts, TextFilePrompts
from fgrpo.core.protocols import Evaluator, Kernel, Objective, Policy, PromptSource, Reward, Sampler
from fgrpo.models.flux import FluxPolicy
from fgrpo.models.flux2 import Flux2KleinPolicy, Flux2Policy
from fgrpo.models.flux_kontext import FluxKontextPolicy
from fgrpo.models.hunyuan_video import HunyuanVideo15Policy
from fgrpo.models.qwen_image import QwenImagePolicy
from fgrpo.models.qwen_image_edit import QwenImageEditPlusPolicy, QwenImageEditPolicy
from fgrpo.models.sd3 import SD3Policy
from fgrpo.models.vector import VectorPolicy
from fgrpo.models.wan import WanImageToVideoPolicy, WanPolicy
from fgrpo.models.z_image import ZImagePolicy
from fgrpo.rewards.aesthetic import Aesthetic
from fgrpo.rewards.clip import CLIPScore, PickScore
from fgrpo.rewards.geneval import GenEval
from fgrpo.rewards.group import Pairwise, Rank
from fgrpo.rewards.hpsv2 import HPSv2
from fgrpo.rewards.imagereward import ImageReward
from fgrpo.rewards.jpeg import JpegCompressibility, JpegIncompressibility
from fgrpo.rewards.ocr import OCRReward
from fgrpo.rewards.remote import RemoteReward
from fgrpo.rewards.similarity import ImageSimilarity
from fgrpo.rewards.target import TargetDistance
from fgrpo.rewards.vlm_judge import VLMJudge
from fgrpo.samplers.branch import BranchSampler
from fgrpo.samplers.fast import FastSampler
from fgrpo.samplers.flash import FlashSampler
from fgrpo.samplers.full import FullSampler
from fgrpo.samplers.kernels.correlated import CorrelatedKernel
from fgrpo.samplers.kernels.cps import CPSKernel
from fgrpo.samplers.kernels.dance import DanceKernel
from fgrpo.samplers.kernels.dpmpp2m import DPMpp2MKernel
from fgrpo.samplers.kernels.dpmpp3m import DPMpp3MKernel
from fgrpo.samplers.kernels.euler import EulerKernel
from fgrpo.samplers.kernels.sde import SDEKernel
from fgrpo.samplers.kernels.wan_sde import WanSDEKernel
from fgrpo.samplers.mixgrpo import MixGRPOSampler
from fgrpo.samplers.ode import ODESampler
from fgrpo.samplers.sparse import SparseSampler
from fgrpo.samplers.tempflow import TempFlowSampler
from fgrpo.worlds.driving.closed_loop import ClosedLoop, Rollout
from fgrpo.worlds.driving.highway import HighwayEvaluator
from fgrpo.worlds.driving.planner import TrajectoryPolicy
from fgrpo.worlds.driving.prompts import DrivingPrompts
from fgrpo.worlds.driving.rewards import PDMS, CaRL, Comfort, Consistency, Drivable, Imitation, Progress, Rules, Safety
from fgrpo.worlds.driving.shadow import ShadowEvaluator
from fgrpo.worlds.shapes.model import ShapesDiT
from fgrpo.worlds.shapes.prompts import ShapesPrompts
from fgrpo.worlds.shapes.verifier import ShapesGold, ShapesGoldEvaluator, ShapesVerifier
from fgrpo.worlds.shapes_edit.model import ShapesEditDiT
from fgrpo.worlds.shapes_edit.prompts import ShapesEditPrompts
from fgrpo.worlds.shapes_edit.verifier import ShapesEditGoldEvaluator, ShapesEditVerifier

KERNELS: dict[str, type[Kernel]] = {
    "correlated": CorrelatedKernel,
    "cps": CPSKernel,
    "dance": DanceKernel,
    "dpmpp2m": DPMpp2MKernel,
    "dpmpp3m": DPMpp3MKernel,
    "euler": EulerKernel,
    "sde": SDEKernel,
    "wan-sde": WanSDEKernel,
}
SAMPLERS: dict[str, type[Sampler]] = {
    "branch": BranchSampler,
    "fast": FastSampler,
    "flash": FlashSampler,
    "full": FullSampler,
    "mixgrpo": MixGRPOSampler,
    "ode": ODESampler,
    "sparse": SparseSampler,
    "tempflow": TempFlowSampler,
}
REWARDS: dict[str, type[Reward]] = {
    "aesthetic": Aesthetic,
    "clip-score": CLIPScore,
    "driving-carl": CaRL,
    "driving-comfort": Comfort,
    "driving-consistency": Consistency,
    "driving-drivable": Drivable,
    "driving-imitation": Imitation,
    "driving-pdms": PDMS,
    "driving-progress": Progress,
    "driving-rollout": Rollout,
    "driving-rules": Rules,
    "driving-safety": Safety,
    "geneval": GenEval,
    "hpsv2": HPSv2,
    "image-similarity": ImageSimilarity,
    "imagereward": ImageReward,
    "jpeg-compressibility": JpegCompressibility,
    "jpeg-incompressibility": JpegIncompressibility,
    "ocr": OCRReward,
    "pairwise": Pairwise,
    "pickscore": PickScore,
    "rank": Rank,
    "remote": RemoteReward,
    "shapes": ShapesVerifier,
    "shapes-edit": ShapesEditVerifier,
    "shapes-gold": ShapesGold,
    "target-distance": TargetDistance,
    "vlm-judge": VLMJudge,
}
MODELS: dict[str, type[Policy]] = {
    "flux": FluxPolicy,
    "flux-kontext": FluxKontextPolicy,
    "flux2": Flux2Policy,
    "flux2-klein": Flux2KleinPolicy,
    "hunyuan-video-1.5": HunyuanVideo15Policy,
    "qwen-image": QwenImagePolicy,
    "qwen-image-edit": QwenImageEditPolicy,
    "qwen-image-edit-plus": QwenImageEditPlusPolicy,
    "sd3": SD3Policy,
    "shapes-dit": ShapesDiT,
    "shapes-edit-dit": ShapesEditDiT,
    "trajectory": TrajectoryPolicy,
    "vector": VectorPolicy,
    "wan": WanPolicy,
    "wan-i2v": WanImageToVideoPolicy,
    "z-image": ZImagePolicy,
}
OBJECTIVES: dict[str, type[Objective]] = {
    "awm": AWM,
    "dgpo": DGPO,
    "dpo": DPO,
    "flow-dppo": FlowDPPO,
    "grpo": GRPO,
    "grpo-guard": GRPOGuard,
    "nft": NFT,
}
PROMPTS: dict[str, type[PromptSource]] = {
    "driving": DrivingPrompts,
    "folder": FolderPrompts,
    "list": ListPrompts,
    "shapes": ShapesPrompts,
    "shapes-edit": ShapesEditPrompts,
    "text-file": TextFilePrompts,
}
EVALUATORS: dict[str, type[Evaluator]] = {
    "driving-closed-loop": ClosedLoop,
    "driving-highway": HighwayEvaluator,
    "driving-shadow": ShadowEvaluator,
    "shapes-edit-gold": ShapesEditGoldEvaluator,
    "shapes-gold": ShapesGoldEvaluator,
}

#: registry kind -> its table
BY_KIND: dict[str, dict[str, type]] = {
    "kernel": KERNELS,
    "sampler": SAMPLERS,
    "reward": REWARDS,
    "model": MODELS,
    "objective": OBJECTIVES,
    "prompts": PROMPTS,
    "evaluator": EVALUATORS,
}
