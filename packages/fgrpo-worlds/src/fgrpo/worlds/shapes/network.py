"""The ``shapes-dit`` network and its weights files: a small pixel-space flow model for the shapes
world (the policy around it is :mod:`fgrpo.worlds.shapes.model`).

The network is diffusers' ``SD3Transformer2DModel`` over 24x24 RGB pixels (patch size 8: one
token per cell of the shapes world's 3x3 grid, 9 image tokens) conditioned by a word-level text
encoder of its own: the shapes grammar has a tiny closed vocabulary, so every word is one token
(``nn.Embedding`` + a learned position embedding + ``text_layers`` small pre-norm transformer
layers). The encoder's output sequence is ``encoder_hidden_states`` (width ``text_width`` =
``joint_attention_dim``); the pooled vector (``pooled_projection_dim``) is a projection of the
leading start token's output and of the mean over the prompt's tokens.

Conventions: latents are pixels in [-1, 1], shape (B, 3, 24, 24); the transformer predicts the
clean image x0 (``prediction: x0`` in the architecture: with 8x8x3 = 192 values per token a
velocity output would have to carry each patch's full noise through the network, which left
every pixel visibly noisy) and :func:`to_velocity` gives v = (x - x0_hat) / sigma = eps - x0 in
float32 (x_sigma = (1 - sigma) x0 + sigma eps).

Weights: a safetensors file whose tensors are ``text.*`` (the text encoder) and ``transformer.*``
(the SD3 transformer) and whose metadata holds the architecture and the vocabulary, so a recipe
names no architecture. The default file ships in the wheel
(``fgrpo/worlds/shapes/weights/shapes-base.safetensors``, made by ``fgrpo.worlds.shapes.pretrain``).

diffusers and safetensors are imported lazily: listing plugins never imports them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

#: The shipped base weights (package data of fgrpo-worlds).
WEIGHTS_RESOURCE = "shapes/weights/shapes-base.safetensors"

PAD, START = "<pad>", "<start>"
SPECIALS = (PAD, START)

PREDICTIONS = ("x0", "velocity")
#: sigma is clamped to this in velocity = (x - x0_hat) / sigma (samplers never evaluate sigma = 0).
SIGMA_FLOOR = 1e-3


def vocabulary_of(prompts: Iterable[str]) -> tuple[str, ...]:
    """The token list of a closed prompt set: the special tokens, then every word, sorted."""
    words = sorted({w for p in prompts for w in tokenize_words(p)})
    return SPECIALS + tuple(words)


def tokenize_words(prompt: str) -> list[str]:
    """Lower case, final full stop dropped, split on white space ("" -> [])."""
    return str(prompt).lower().strip().rstrip(".").split()


# --- the architecture ---------------------------------------------------------------------------


def _words(words: Iterable[str]) -> tuple[str, ...]:
    return tuple(words)


@attrs.frozen
class Architecture:
    """Everything needed to build the network; stored as JSON in the weights file's metadata."""

    vocab: tuple[str, ...] = attrs.field(converter=_words)
    hidden: int = 192
    layers: int = 4
    heads: int = 3
    text_width: int = 128
    text_layers: int = 1
    text_heads: int = 2
    max_words: int = 10
    size: int = 24
    patch: int = 8
    channels: int = 3
    qk_norm: str | None = "rms_norm"
    #: what the transformer outputs: "x0" (the clean pixels; velocity = (x - x0_hat) / sigma) or
    #: "velocity" (v directly). x0 lies on a tiny set per cell while v carries the full 192-dim
    #: noise of each 8x8x3 patch through a 192-wide network (as in JiT, "Back to Basics: Let
    #: Denoising Generative Models Denoise"). Measured with this architecture: v-prediction still
    #: had a median pixel error of 17/255 and 0.4% verifier-readable cells after 1200 steps;
    #: x0-prediction had 98% readable cells after 300 steps and 100% from 900 on.
    prediction: str = "x0"
    #: source images an editing model sees beside the state (``shapes-edit-dit``; 0 for the
    #: text-to-image base): each one's cells are more tokens of the same sequence at the *same*
    #: positions as the state's cells, told apart by a learned marker per source image (FLUX
    #: Kontext's in-sequence conditioning: the same (h, w) ids, another first coordinate).
    #: Measured: with positions of their own (the sources' cells to the right of the state's) a
    #: 0.46M transformer did not learn to copy the source in 2000 steps (untouched cells all
    #: preserved in 8% of edits); see :class:`SourceTokensPatchEmbed`.
    source_images: int = 0
    #: factor on SD3's fixed sin-cos position embedding of the image tokens. At sigma 1 a token is
    #: the embedding of a pure-noise patch (norm 15 in the shipped base) plus its position (norm
    #: 9.8; neighbouring cells 1.7 apart). Measured: 4 did not make the base place by relation
    #: (fgrpo.worlds.shapes.pretrain's docstring).
    position_scale: float = 1.0
    #: a per-cell term on each state token from the pooled text vector (zero at initialisation):
    #: the relation, which the pooled vector carries, reaches each cell's token directly instead of
    #: only through attention (:class:`CellConditionedPatchEmbed`). Text-to-image networks only.
    cell_conditioning: bool = False
    #: width of a layout planner (0: none): an MLP from the pooled text to an image, the network's
    #: plan of where things go, embedded like the state's pixels (zero at initialisation) and
    #: added to each state token, as text-to-layout-to-image generators plan a layout before they
    #: draw it (LLM-grounded diffusion, Lian et al. 2023). What the relation changes is then a
    #: function of the text alone, not a product of position and text the attention must learn
    #: (:class:`PlannedPatchEmbed`). Text-to-image networks only.
    layout_plan: int = 0

    def __attrs_post_init__(self) -> None:
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"prediction {self.prediction!r}; allowed: {', '.join(PREDICTIONS)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must be a multiple of heads {self.heads}")
        if self.text_width % self.text_heads:
            raise ValueError(f"text_width {self.text_width} must be a multiple of text_heads {self.text_heads}")
        if self.cell_conditioning and self.source_images:
            raise ValueError("cell_conditioning is for text-to-image networks (source_images 0)")
        if self.layout_plan and self.source_images:
            raise ValueError("layout_plan is for text-to-image networks (source_images 0)")
        if self.layout_plan and self.cell_conditioning:
            raise ValueError("layout_plan and cell_conditioning are two ways to the same place: choose one")
        if self.layout_plan < 0:
            raise ValueError(f"layout_plan {self.layout_plan} must be >= 0 (0: no planner)")
        if not self.position_scale > 0:
            raise ValueError(f"position_scale {self.position_scale} must be > 0")
        if self.size % self.patch:
            raise ValueError(f"size {self.size} must be a multiple of patch {self.patch}")
        if tuple(self.vocab[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"the vocabulary must start with {SPECIALS}")

    @property
    def tokens(self) -> int:
        """Text sequence length: the start token and ``max_words`` words."""
        return self.max_words + 1

    @property
    def position_grid(self) -> int:
        """Side of the transformer's position-embedding grid in patches: the state's cells (the
        source images' cells share their positions)."""
        return self.size // self.patch

    def to_json(self) -> str:
        return json.dumps({**attrs.asdict(self), "vocab": list(self.vocab)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Architecture:
        return cls(**json.loads(text))


class TextBlock(nn.Module):
    """Pre-norm self-attention + GELU MLP over the word tokens (padding masked as keys)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, n, w = h.shape
        q, k, v = self.qkv(self.norm1(h)).reshape(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :]  # (B, 1, 1, N) True = attend
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.proj(a.transpose(1, 2).reshape(b, n, w))
        return h + self.mlp(self.norm2(h))


class TextEncoder(nn.Module):
    """Word ids (B, tokens) -> (encoder_hidden_states (B, tokens, width), pooled (B, width))."""

    def __init__(self, arch: Architecture):
        super().__init__()
        w = arch.text_width
        self.embed = nn.Embedding(len(arch.vocab), w)
        self.position = nn.Parameter(torch.zeros(1, arch.tokens, w))
        self.blocks = nn.ModuleList(TextBlock(w, arch.text_heads) for _ in range(arch.text_layers))
        self.norm = nn.LayerNorm(w)
        self.pool = nn.Linear(2 * w, w)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = ids != 0  # the start token is never padding: no row is fully masked
        h = self.embed(ids) + self.position[:, : ids.shape[1]]
        for block in self.blocks:
            h = block(h, keep)
        h = self.norm(h)
        k = keep.to(h.dtype)[..., None]
        mean = (h * k).sum(1) / k.sum(1)
        pooled = self.pool(torch.cat([h[:, 0], mean], dim=-1))
        return h, pooled


def _patch_embed_keys(arch: Architecture, embed_dim: int) -> dict[str, int]:
    """SD3's own PatchEmbed arguments for this architecture (what SD3Transformer2DModel builds)."""
    return dict(
        height=arch.size,
        width=arch.size,
        patch_size=arch.patch,
        in_channels=arch.channels,
        embed_dim=embed_dim,
        pos_embed_max_size=arch.position_grid,
    )


def cell_conditioned_patch_embed(arch: Architecture, embed_dim: int) -> nn.Module:
    """SD3's patch embedding plus ``cell_bias(pooled)``, one row per cell (``pooled`` is set by
    :func:`transformer_output` for the call: SD3's transformer passes the embedding only pixels)."""
    from diffusers.models.embeddings import PatchEmbed

    class CellConditionedPatchEmbed(PatchEmbed):
        def __init__(self, cells: int, text_width: int, **kwargs: Any):
            super().__init__(**kwargs)
            self.cell_bias = nn.Linear(text_width, cells * kwargs["embed_dim"])
            nn.init.zeros_(self.cell_bias.weight)
            nn.init.zeros_(self.cell_bias.bias)
            self.pooled: torch.Tensor | None = None
            self.reads_pooled = True

        def forward(self, latent: torch.Tensor) -> torch.Tensor:
            tokens = super().forward(latent)
            if self.pooled is None:
                raise RuntimeError("a cell-conditioned network is called through transformer_output")
            return tokens + self.cell_bias(self.pooled).reshape(tokens.shape).to(tokens.dtype)

    return CellConditionedPatchEmbed(arch.position_grid**2, arch.text_width, **_patch_embed_keys(arch, embed_dim))


def planned_patch_embed(arch: Architecture, embed_dim: int) -> nn.Module:
    """SD3's patch embedding plus the embedded layout plan (:class:`PlannedPatchEmbed`)."""
    from diffusers.models.embeddings import PatchEmbed

    class PlannedPatchEmbed(PatchEmbed):
        """``planner(pooled)`` is an image (B, C, size, size), the plan; ``plan_proj`` embeds its
        patches as ``proj`` does the state's (zero at initialisation, so the network starts as
        the plain one) and each state token gets its cell's. ``pooled`` is set by
        :func:`transformer_output` for the call."""

        def __init__(self, arch: Architecture, **kwargs: Any):
            super().__init__(**kwargs)
            self.size, self.channels = arch.size, arch.channels
            self.planner = nn.Sequential(
                nn.Linear(arch.text_width, arch.layout_plan),
                nn.GELU(),
                nn.Linear(arch.layout_plan, arch.channels * arch.size**2),
            )
            self.plan_proj = nn.Conv2d(arch.channels, kwargs["embed_dim"], arch.patch, stride=arch.patch)
            nn.init.zeros_(self.plan_proj.weight)
            nn.init.zeros_(self.plan_proj.bias)  # type: ignore[arg-type]  # Conv2d's bias=True
            self.pooled: torch.Tensor | None = None
            self.reads_pooled = True

        def plan(self, pooled: torch.Tensor) -> torch.Tensor:
            return self.planner(pooled).reshape(-1, self.channels, self.size, self.size)

        def forward(self, latent: torch.Tensor) -> torch.Tensor:
            tokens = super().forward(latent)
            if self.pooled is None:
                raise RuntimeError("a planning network is called through transformer_output")
            plan = self.plan_proj(self.plan(self.pooled.to(tokens.dtype)))
            return tokens + plan.flatten(2).transpose(1, 2)

    return PlannedPatchEmbed(arch, **_patch_embed_keys(arch, embed_dim))


def source_tokens_patch_embed(arch: Architecture, embed_dim: int) -> nn.Module:
    """The editing networks' patch embedding (:class:`SourceTokensPatchEmbed`), built lazily
    because diffusers is an optional dependency."""
    from diffusers.models.embeddings import PatchEmbed

    class SourceTokensPatchEmbed(PatchEmbed):
        """SD3's patch embedding for an input of the state and its source images side by side
        (B, C, size, size * (1 + sources)): each image is embedded on its own with the state's
        positions, a source's tokens get its learned ``source_marker`` row, and the tokens are
        ordered row-major over the (side, side * (1 + sources)) grid the transformer unpatchifies,
        so the output's first ``size`` columns are the state's."""

        def __init__(self, sources: int, **kwargs: Any):
            super().__init__(**kwargs)
            self.source_marker = nn.Parameter(0.02 * torch.randn(sources, kwargs["embed_dim"]))

        def forward(self, latent: torch.Tensor) -> torch.Tensor:
            size = latent.shape[-2]
            state, *sources = (
                super(SourceTokensPatchEmbed, self).forward(part) for part in latent.split(size, dim=-1)
            )
            side = size // self.patch_size
            grids = [state] + [t + self.source_marker[i].to(t.dtype) for i, t in enumerate(sources)]
            b, _, d = state.shape
            return torch.cat([g.reshape(b, side, side, d) for g in grids], dim=2).reshape(b, -1, d)

    return SourceTokensPatchEmbed(arch.source_images, **_patch_embed_keys(arch, embed_dim))


class ShapesNetwork(nn.Module):
    """The whole model: ``text`` (:class:`TextEncoder`) + ``transformer`` (SD3Transformer2DModel)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        # from its own module: mypy reads diffusers' top-level names as its dummy objects
        from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

        self.arch = arch
        self.word_ids = {w: i for i, w in enumerate(arch.vocab)}
        self.text = TextEncoder(arch)
        self.transformer = SD3Transformer2DModel(
            sample_size=arch.size,
            patch_size=arch.patch,
            in_channels=arch.channels,
            out_channels=arch.channels,
            num_layers=arch.layers,
            attention_head_dim=arch.hidden // arch.heads,
            num_attention_heads=arch.heads,
            joint_attention_dim=arch.text_width,
            caption_projection_dim=arch.hidden,
            pooled_projection_dim=arch.text_width,
            pos_embed_max_size=arch.position_grid,
            qk_norm=arch.qk_norm,
        )
        if arch.source_images:
            self.transformer.pos_embed = source_tokens_patch_embed(arch, self.transformer.inner_dim)
        if arch.cell_conditioning:
            self.transformer.pos_embed = cell_conditioned_patch_embed(arch, self.transformer.inner_dim)
        if arch.layout_plan:
            self.transformer.pos_embed = planned_patch_embed(arch, self.transformer.inner_dim)
        if arch.position_scale != 1.0:  # a persistent buffer: the file keeps the scaled values
            self.transformer.pos_embed.pos_embed.mul_(arch.position_scale)

    def token_ids(self, prompts: Sequence[str], device: torch.device | str = "cpu") -> torch.Tensor:
        """(B, tokens) long: the start token, the words, then padding. Unknown words and prompts
        longer than ``max_words`` raise ``ValueError``."""
        start = self.word_ids[START]
        rows = []
        for prompt in prompts:
            words = tokenize_words(prompt)
            unknown = [w for w in words if w not in self.word_ids or w in SPECIALS]
            if unknown:
                known = ", ".join(self.arch.vocab[len(SPECIALS) :])
                raise ValueError(f"prompt {prompt!r}: word(s) {unknown} not in the shapes-dit vocabulary ({known})")
            if len(words) > self.arch.max_words:
                raise ValueError(
                    f"prompt {prompt!r} has {len(words)} words; this model reads at most {self.arch.max_words}"
                )
            ids = [start] + [self.word_ids[w] for w in words]
            rows.append(ids + [0] * (self.arch.tokens - len(ids)))
        return torch.tensor(rows, dtype=torch.long, device=device)

    def encode(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        device = self.text.embed.weight.device
        embeds, pooled = self.text(self.token_ids(prompts, device))
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def forward(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        embeds: torch.Tensor,
        pooled: torch.Tensor,
        source: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The transformer's raw output for pixels ``x`` (B, 3, 24, 24) at noise level ``sigma``
        (B,): the clean image x0 (``arch.prediction == "x0"``) or the velocity. An editing
        network also takes ``source`` (B, 3, 24, 24 * source_images), its source images' pixels."""
        return transformer_output(self.transformer, self.arch, x, sigma, embeds, pooled, source)


def transformer_output(
    transformer: nn.Module,
    arch: Architecture,
    x: torch.Tensor,
    sigma: torch.Tensor,
    embeds: torch.Tensor,
    pooled: torch.Tensor,
    source: torch.Tensor | None = None,
) -> torch.Tensor:
    """One call of a shapes network's transformer: the state's tokens, then (editing) the source
    images' tokens to their right in one sequence, at the same timestep; the output of the state's
    tokens only (as FLUX Kontext keeps ``noise_pred[:, :latents.size(1)]``)."""
    if arch.source_images:
        if source is None or source.shape[-1] != arch.size * arch.source_images:
            shape = None if source is None else tuple(source.shape)
            raise ValueError(
                f"this editing network needs source pixels (B, 3, {arch.size}, {arch.size * arch.source_images}), got "
                f"{shape}"
            )
        x = torch.cat([x, source.to(x)], dim=-1)
    # the text-reading embeddings (cell term, layout plan) get the pooled text for this call only
    cells: Any = transformer.pos_embed if getattr(transformer.pos_embed, "reads_pooled", False) else None
    if cells is not None:
        cells.pooled = pooled
    try:
        out = transformer(
            hidden_states=x,
            timestep=sigma * 1000.0,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
    finally:
        if cells is not None:
            cells.pooled = None
    return out[..., : arch.size] if arch.source_images else out


def to_velocity(output: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, prediction: str) -> torch.Tensor:
    """The float32 velocity eps - x0 from the transformer's ``output`` at state ``x``, level ``sigma`` (B,)."""
    output = output.float()
    if prediction == "velocity":
        return output
    s = sigma.float().clamp_min(SIGMA_FLOOR).reshape(-1, *([1] * (x.ndim - 1)))
    return (x.float() - output) / s


def flow_loss(
    output: torch.Tensor,
    x0: torch.Tensor,
    eps: torch.Tensor,
    sigma: torch.Tensor,
    prediction: str,
    floor: float = 0.05,
) -> torch.Tensor:
    """The pretraining loss: velocity MSE against eps - x0 for the transformer's ``output`` at
    x_sigma = (1 - sigma) x0 + sigma eps. With x0-prediction (JiT's "v-loss") the velocity implied
    by the prediction, sigma floored at ``floor``, i.e. ||x0_hat - x0||^2 / max(sigma, floor)^2:
    low noise levels weigh more, which is where the exact palette colours and glyph edges are set."""
    if prediction == "velocity":
        return (output - (eps - x0)).pow(2).mean()
    s = sigma.clamp_min(floor).reshape(-1, *([1] * (x0.ndim - 1)))
    return ((output - x0) / s).pow(2).mean()


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --- weights files ------------------------------------------------------------------------------


def default_weights_path(resource: str = WEIGHTS_RESOURCE) -> str:
    """The shipped base weights, as a file path (package data of fgrpo-worlds)."""
    from importlib.resources import files

    return str(files("fgrpo.worlds").joinpath(resource))


def save_network(
    network: ShapesNetwork,
    path: str | Path,
    dtype: torch.dtype = torch.float16,
    extra: Mapping[str, str] | None = None,
    *,
    transformer_state: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write ``network`` as safetensors (floating tensors cast to ``dtype``) with its architecture
    (and ``extra`` strings, e.g. how it was trained) in the metadata; ``transformer_state``: the
    transformer's weights to write instead of its current ones (a checkpoint's, or the EMA's)."""
    from safetensors.torch import save_file

    whole = dict(network.state_dict())
    if transformer_state is not None:
        whole.update({f"transformer.{k}": v for k, v in transformer_state.items()})
    state = {
        k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
        for k, v in whole.items()
    }
    metadata = {"format": "pt", "fgrpo_model": "shapes-dit", "architecture": network.arch.to_json(), **(extra or {})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=metadata)


def read_metadata(path: str | Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_network(path: str | Path) -> ShapesNetwork:
    """Build the network the file describes and load its weights (as float32)."""
    from safetensors.torch import load_file

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"model.path: no such file {str(file)!r} (a shapes-dit safetensors file)")
    meta = read_metadata(file)
    if "architecture" not in meta:
        raise ValueError(f"model.path: {str(file)!r} has no 'architecture' metadata: not a shapes-dit weights file")
    network = ShapesNetwork(Architecture.from_json(meta["architecture"]))
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(file)).items()}
    expected = network.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"model.path: {str(file)!r} does not fit its own architecture: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}"
        )
    network.load_state_dict(state, strict=True)
    return network


def edit_vocabulary() -> tuple[str, ...]:
    """The shapes-edit instructions' words (for ``random_init`` of ``shapes-edit-dit``); the
    editing pretraining tool builds the same list from every instruction (:func:`vocabulary_of`)."""
    words = ["make", "the", "change", "number", "of", "to", "add", "a", "remove", "move"]
    words += ["one", "two", "three", "four", "top", "bottom", "left", "right", "middle"]
    words += ["red", "green", "blue", "yellow"]
    for shape in ("square", "circle", "triangle"):
        words += [shape, shape + "s"]
    return SPECIALS + tuple(sorted(set(words)))


@functools.cache
def default_vocabulary() -> tuple[str, ...]:
    """The shapes grammar's words (for ``random_init``), as the shipped base reads them: its weights
    file's vocabulary, which ``fgrpo.worlds.shapes.pretrain`` builds from the grammar itself
    (:func:`vocabulary_of` over every prompt of :mod:`fgrpo.worlds.shapes`), so the words are
    written in one place."""
    return Architecture.from_json(read_metadata(default_weights_path())["architecture"]).vocab


__all__ = [
    "Architecture",
    "PREDICTIONS",
    "SPECIALS",
    "ShapesNetwork",
    "TextEncoder",
    "count_parameters",
    "default_vocabulary",
    "default_weights_path",
    "edit_vocabulary",
    "flow_loss",
    "load_network",
    "read_metadata",
    "save_network",
    "to_velocity",
    "transformer_output",
    "tokenize_words",
    "vocabulary_of",
]
