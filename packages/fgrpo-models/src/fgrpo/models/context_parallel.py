"""Context (sequence) parallelism of a diffusers transformer: ``model.context_parallel:
{ulysses_degree: U}`` splits every sample's tokens over the U processes of a group (Ulysses).

Each process of a group holds 1/U of every sample's tokens (contiguous blocks, any length) through
the whole transformer; fgrpo's attention processors (:class:`JointUlysses` for SD3's joint
attention, :class:`WanUlysses` for Wan's self-attention) compute q, k, v of their tokens and trade
them by an all-to-all for the whole sequence with H / U heads, attend, and trade back
(:mod:`fgrpo.models._ulysses`, differentiable). SD3 splits its text tokens too (joint attention
treats them as more tokens, so nothing else is replicated); Wan's cross-attention keeps the text
whole on every process (each process's queries attend to all of it: no exchange). The split
happens after the patch (and text) embedding, the gather after the output projection, by hooks,
so the transformer's own forward runs unchanged and its output is whole on every process.

The processes of a group roll out and train on the same prompts and noise (the launch gives each
group one share of the batch: ``data_rank`` / ``data_processes`` in :mod:`fgrpo.core.launch`),
so they score the same outputs, and each one's weight gradients are its tokens' part: the
data-parallel step sums them within the group and averages over the groups.

This is fgrpo's own path, not diffusers' ``enable_parallelism``/``ContextParallelConfig``, which
maps each process to an accelerator (``rank % torch.accelerator.device_count()``:
ZeroDivisionError without GPUs in diffusers 0.42.1) and so cannot be set up, or tested, on CPUs
over gloo. Ring attention (``ring_degree > 1``) is not built: refused with its reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fgrpo.models._ulysses import Ulysses, new_groups

#: the keys of ``model.context_parallel``
KEYS = ("ulysses_degree", "ring_degree")

HELP = (
    "split each sample's tokens over the processes of a group (Ulysses: all-to-all over attention heads; SD3 and Wan "
    "transformers): a mapping with ulysses_degree (an integer > 1 dividing the process count and the heads); "
    "ring_degree: 1 (ring attention is not built); null: off. Each group shares prompts, noise and rewards; a "
    "data-parallel launch only"
)


def convert(value: Any) -> dict[str, int] | None:
    """``model.context_parallel`` normalised: None, or both degrees as integers. Raises
    ``ValueError("got ...; allowed ...")`` for bad values (reported under the key by validate)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"got {value!r}; allowed: null (off) or a mapping with keys {', '.join(KEYS)}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"got unknown key(s) {', '.join(map(repr, unknown))}; allowed keys: {', '.join(KEYS)}")
    spec = {key: value.get(key, 1) for key in KEYS}
    for key, degree in spec.items():
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(f"got {key} {degree!r}; allowed: a positive integer")
    if spec["ring_degree"] > 1:
        raise ValueError(
            f"got ring_degree {spec['ring_degree']}: ring attention (key/value blocks passed round) is not built; "
            "allowed: ring_degree 1, with ulysses_degree > 1 (all-to-all over heads)"
        )
    if spec["ulysses_degree"] < 2:
        raise ValueError(
            f"got {dict(spec)}: one process per sample is no context parallelism; allowed: ulysses_degree > 1, or null"
        )
    return spec


def refusal(spec: Mapping[str, int], processes: int) -> str | None:
    """Why a run with ``model.context_parallel: spec`` cannot be built with ``processes``
    processes (None: it can)."""
    u = spec["ulysses_degree"]
    if processes % u or processes < u:
        return (
            f"model.context_parallel: got ulysses_degree {u} under {processes} process(es); the processes must make "
            f"whole groups of {u} (launch a multiple of {u} processes, e.g. accelerate launch --num_processes {u}), "
            "or set model.context_parallel: null"
        )
    return None


def check(spec: Mapping[str, int] | None) -> None:
    """Refuse ``spec`` (not None) where this launch cannot run it (before the pipeline loads)."""
    if spec is None:
        return
    import torch.distributed as dist

    processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    reason = refusal(spec, processes)
    if reason is not None:
        raise ValueError(reason)


def enable_on(pipeline: Any, spec: Mapping[str, int] | None) -> int:
    """:func:`enable` on a pipeline's transformer(s) (Wan 2.2: both experts)."""
    networks = [getattr(pipeline, name, None) for name in ("transformer", "transformer_2")]
    return enable([m for m in networks if isinstance(m, torch.nn.Module)], spec, pipeline)


def enable(transformers: list[torch.nn.Module], spec: Mapping[str, int] | None, pipeline: Any = None) -> int:
    """Split ``transformers``' sequences over this process's group of ``spec``'s processes (creating
    the groups: every process must call this); the group size (1: off)."""
    if spec is None:
        return 1
    size = spec["ulysses_degree"]
    if pipeline is not None and getattr(pipeline, "config", {}).get("expand_timesteps"):
        raise ValueError(
            "model.context_parallel: Wan 2.2 TI2V (expand_timesteps: one timestep per token) is not split yet; "
            "set model.context_parallel: null"
        )
    for transformer in transformers:
        _supported(transformer, size)
    ulysses = new_groups(size)
    for transformer in transformers:
        install(transformer, ulysses)
    return size


def _supported(transformer: Any, size: int) -> None:
    name = type(transformer).__name__
    if name not in WIRING:
        raise ValueError(
            f"model.context_parallel: got a {name}; allowed: the SD3 and Wan transformers (SD3Transformer2DModel, "
            f"WanTransformer3DModel), or null"
        )
    heads = int(transformer.config.num_attention_heads)
    if heads % size:
        raise ValueError(
            f"model.context_parallel: got ulysses_degree {size}; it must divide the transformer's {heads} attention "
            "heads (each process attends with heads / ulysses_degree of them)"
        )


def install(transformer: torch.nn.Module, ulysses: Ulysses) -> None:
    """fgrpo's processors on ``transformer``'s attention, and the hooks that split its input
    tokens and gather its output."""
    WIRING[type(transformer).__name__](transformer, ulysses)


def _wire_sd3(transformer: Any, ulysses: Ulysses) -> None:
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    attention = [m for m in transformer.modules() if hasattr(m, "set_processor")]
    _only(attention, JointAttnProcessor2_0)
    for module in attention:
        module.set_processor(JointUlysses(ulysses))
    transformer.pos_embed.register_forward_hook(lambda _m, _a, out: ulysses.split(out, "image"))
    transformer.context_embedder.register_forward_hook(lambda _m, _a, out: ulysses.split(out, "text"))
    transformer.proj_out.register_forward_hook(lambda _m, _a, out: ulysses.gather(out, "image"))


def _wire_wan(transformer: Any, ulysses: Ulysses) -> None:
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    _only([block.attn1 for block in transformer.blocks], WanAttnProcessor)
    for block in transformer.blocks:
        block.attn1.set_processor(WanUlysses(ulysses))  # attn2 (cross-attention) keeps diffusers': text whole

    def split_patches(_m: Any, _a: Any, out: torch.Tensor) -> torch.Tensor:
        # (B, C, F, H, W): the forward flattens F, H, W into the sequence; hand it (B, C, 1, 1, mine)
        return ulysses.split(out.flatten(2), "image", dim=2).unsqueeze(2).unsqueeze(2)

    transformer.patch_embedding.register_forward_hook(split_patches)
    transformer.proj_out.register_forward_hook(lambda _m, _a, out: ulysses.gather(out, "image"))


def _only(attention: list[Any], expected: type) -> None:
    """Refuse attention modules whose processor is not diffusers' ``expected`` one, which fgrpo's
    processor replaces (another, e.g. a custom backend's, would attend over this process's tokens only)."""
    others = sorted({type(m.processor).__name__ for m in attention if type(m.processor) is not expected})
    if others:
        raise ValueError(
            f"model.context_parallel: the transformer's attention uses {', '.join(others)}; fgrpo splits the "
            f"sequence for diffusers' {expected.__name__} only; set model.context_parallel: null"
        )


#: how each transformer class is split
WIRING = {"SD3Transformer2DModel": _wire_sd3, "WanTransformer3DModel": _wire_wan}


class JointUlysses:
    """diffusers' ``JointAttnProcessor2_0`` (SD3, SD3.5) with the attention over the whole sequence
    of the group's tokens: each process's image and text blocks, H / U heads per process."""

    def __init__(self, ulysses: Ulysses) -> None:
        self.ulysses = ulysses

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        image_tokens = hidden_states.shape[1]
        query, key, value = _heads_first(attn, hidden_states, attn.to_q, attn.to_k, attn.to_v)
        query, key = _norm(attn.norm_q, query), _norm(attn.norm_k, key)
        kinds: tuple[str, ...] = ("image",)
        if encoder_hidden_states is not None:
            kinds = ("image", "text")
            q2, k2, v2 = _heads_first(attn, encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            q2, k2 = _norm(attn.norm_added_q, q2), _norm(attn.norm_added_k, k2)
            query, key, value = (torch.cat([a, b], dim=2) for a, b in ((query, q2), (key, k2), (value, v2)))
        out = self.attend(query, key, value, self.ulysses.sizes(*kinds))
        out = out.transpose(1, 2).reshape(out.shape[0], -1, attn.heads * out.shape[-1]).to(query.dtype)
        context = None
        if encoder_hidden_states is not None:
            out, context = out[:, :image_tokens], out[:, image_tokens:]
            if not attn.context_pre_only:
                context = attn.to_add_out(context)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, context) if encoder_hidden_states is not None else out

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """(B, H, my tokens, D) each -> attention output (B, H, my tokens, D) over every process's
        tokens (the sequence a group attends over is its blocks in process order: the image and text
        tokens interleaved by block, which attention without a mask does not see)."""
        u = self.ulysses
        q, k, v = (u.to_heads(t.transpose(1, 2), sizes).transpose(1, 2) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        return u.to_tokens(out.transpose(1, 2), sizes).transpose(1, 2)


def _heads_first(attn: Any, x: torch.Tensor, *projections: Any) -> list[torch.Tensor]:
    """(B, tokens, H x D) projected -> (B, H, tokens, D), as diffusers' processor lays them out."""
    out = [p(x) for p in projections]
    return [t.view(x.shape[0], -1, attn.heads, t.shape[-1] // attn.heads).transpose(1, 2) for t in out]


def _norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    return norm(x) if norm is not None else x


class WanUlysses:
    """diffusers' ``WanAttnProcessor`` for Wan's self-attention with the attention over the whole
    sequence: q, k, v of this process's tokens (projections and the RMS norms across heads are
    per token), exchanged for every token with H / U heads, rotated by the whole sequence's rotary
    embedding there, attended, exchanged back."""

    def __init__(self, ulysses: Ulysses) -> None:
        self.ulysses = ulysses

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("model.context_parallel: fgrpo's Wan processor serves self-attention without a mask")
        # None: self-attention (diffusers' own processor passes None here too; its annotation says Tensor)
        query, key, value = _get_qkv_projections(attn, hidden_states, None)  # type: ignore[arg-type]
        query, key = attn.norm_q(query), attn.norm_k(key)
        sizes = self.ulysses.sizes("image")
        q, k, v = (self.ulysses.to_heads(t.unflatten(2, (attn.heads, -1)), sizes) for t in (query, key, value))
        if rotary_emb is not None:
            q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
        out = dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
        out = self.ulysses.to_tokens(out, sizes).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _rotate(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan rotary embedding (transformer_wan.py's ``apply_rotary_emb``), on the whole sequence."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)
