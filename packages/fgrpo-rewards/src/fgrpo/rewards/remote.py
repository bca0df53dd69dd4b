"""``remote``: score with a reward that runs in another process or on another machine, served by
``fgrpo serve-reward NAME`` (:mod:`fgrpo.rewards.serving`), which serves any registered reward
over HTTP.

One GPU box can host a big reward model (a VLM judge, GenEval's detector) for many trainers. The
wire format is safetensors both ways, so nothing is unpickled: a request holds the ``outputs``
tensor (uint8 images by default: 4x fewer bytes than float32, and what image rewards convert to
anyway) with the prompts and metadata as JSON in the safetensors header; the answer holds
``scores`` and the tensor details, other details as JSON. The token (``Authorization: Bearer``)
comes from an environment variable, never from a recipe. The standard library's HTTP client
(:mod:`fgrpo.rewards.http`: a total deadline per request, answers size-capped).

Edits: a served reward that compares outputs with their sources (``accepts_sources``: image
similarity, an edit judge) says so in ``/health``; the client then takes the sources from the
trainer and sends them with each batch (tensors ``source/i/k`` on the same wire).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult
from fgrpo.rewards.http import ServiceError, post, token_from_env

log = logging.getLogger(__name__)

TOKEN_ENV = "FGRPO_REWARD_TOKEN"
WIRES = ("uint8", "float16", "float32")


# --- the wire format ---------------------------------------------------------------------------


def _is_images(outputs: Any) -> bool:
    return isinstance(outputs, torch.Tensor) and outputs.dim() in (4, 5) and outputs.shape[-3] == 3


def _on_wire(images: torch.Tensor, wire: str) -> tuple[torch.Tensor, str]:
    if wire == "uint8" and _is_images(images):
        # on the outputs' own device (a GPU quantises fast and copies 4x fewer bytes to the host),
        # in place after the one copy mul makes: the encoding cost is mostly these passes
        return images.detach().mul(255).round_().clamp_(0, 255).to(torch.uint8), "uint8"
    wire = "float16" if wire == "float16" else "float32"
    return images.detach().to(getattr(torch, wire)), wire


def encode_request(
    outputs: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    wire: str,
    sources: Sequence[Sequence[torch.Tensor]] | None = None,
) -> bytes:
    """The request body; ``sources`` (edits: each sample's source images, (3, H, W) in [0, 1])
    travel as tensors ``source/i/k`` on the same wire, their counts in the header."""
    from safetensors.torch import save

    if not isinstance(outputs, torch.Tensor):
        raise ValueError(f"remote: outputs must be a tensor, got {type(outputs).__name__}")
    tensor, used = _on_wire(outputs, wire)
    tensors = {"outputs": tensor.cpu().contiguous()}
    for i, row in enumerate(sources or ()):
        for k, image in enumerate(row):
            tensors[f"source/{i}/{k}"] = _on_wire(image[None], wire)[0][0].cpu().contiguous()
    try:
        header = {
            "prompts": json.dumps([str(p) for p in prompts]),
            "metadata": json.dumps([dict(m) for m in metadata]),
            "wire": used,
        }
    except TypeError as exc:
        raise ValueError(f"remote: prompts and metadata travel as JSON: {exc}") from None
    if sources is not None:
        header["sources"] = json.dumps([len(row) for row in sources])
    return save(tensors, metadata=header)


def decode_request(
    body: bytes,
) -> tuple[torch.Tensor, list[str], list[dict[str, Any]], list[tuple[torch.Tensor, ...]] | None]:
    """(outputs, prompts, metadata, sources or None); raises ValueError on anything that is not a
    well-formed request."""
    from safetensors.torch import load

    tensors = load(body)
    header = _header(body)
    if (
        "outputs" not in tensors
        or header is None
        or any(k != "outputs" and not k.startswith("source/") for k in tensors)
    ):
        raise ValueError("expected a safetensors body with one tensor 'outputs' and prompts/metadata in its header")
    prompts, metadata = json.loads(header.get("prompts", "null")), json.loads(header.get("metadata", "null"))
    outputs = tensors["outputs"]
    n = outputs.shape[0] if outputs.dim() else -1
    if not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts) and len(prompts) == n):
        raise ValueError(f"expected {n} prompts (strings), got {str(prompts)[:200]}")
    if not (isinstance(metadata, list) and all(isinstance(m, dict) for m in metadata) and len(metadata) == n):
        raise ValueError(f"expected {n} metadata objects, got {str(metadata)[:200]}")
    scale = 255.0 if header.get("wire") == "uint8" else 1.0
    sources = None
    if "sources" in header:
        counts = json.loads(header["sources"])
        if not (isinstance(counts, list) and len(counts) == n and all(isinstance(c, int) and c >= 0 for c in counts)):
            raise ValueError(f"expected {n} source counts, got {str(counts)[:200]}")
        try:
            sources = [
                tuple(tensors[f"source/{i}/{k}"].float() / scale for k in range(c)) for i, c in enumerate(counts)
            ]
        except KeyError as exc:
            raise ValueError(f"a source image the header announces is missing: {exc}") from None
    outputs = outputs.float()
    if scale != 1.0:
        outputs.div_(scale)
    return outputs, prompts, metadata, sources


def _header(body: bytes) -> dict[str, str] | None:
    """The string metadata of a safetensors body (8-byte little-endian length, then JSON)."""
    size = int.from_bytes(body[:8], "little")
    return json.loads(body[8 : 8 + size]).get("__metadata__")


def encode_result(result: RewardResult) -> bytes:
    from safetensors.torch import save

    tensors = {"scores": torch.as_tensor(result.scores).detach().float().cpu().contiguous()}
    other: dict[str, Any] = {}
    for key, value in result.details.items():
        if isinstance(value, torch.Tensor):  # a copy: a detail may be the scores tensor itself
            tensors[f"detail/{key}"] = value.detach().cpu().clone().contiguous()
        else:
            other[key] = value if isinstance(value, (list, tuple, str, int, float, bool, type(None))) else str(value)
    return save(tensors, metadata={"details": json.dumps(other, default=str)})


def decode_result(body: bytes) -> RewardResult:
    from safetensors.torch import load

    tensors = load(body)
    header = _header(body) or {}
    if "scores" not in tensors:
        raise ValueError("no 'scores' tensor")
    details: dict[str, Any] = json.loads(header.get("details", "{}"))
    details.update({k.removeprefix("detail/"): v for k, v in tensors.items() if k.startswith("detail/")})
    return RewardResult(scores=tensors["scores"], details=details)


# --- the client reward -------------------------------------------------------------------------


@attrs.define
class RemoteReward:
    """Scores by POSTing batches to ``fgrpo serve-reward`` at ``url``; the served reward's scores
    and details come back unchanged (images travel as uint8 unless ``wire`` says otherwise)."""

    url: str = param("http://127.0.0.1:8765", help="where fgrpo serve-reward listens")
    serves: str | None = param(None, help="the reward the server must serve (checked when built); none = any")
    token_env: str | None = param(TOKEN_ENV, help="environment variable holding the shared token; unset = no token")
    wire: str = param("uint8", choices=WIRES, help="how images travel (uint8 = as saved images; float32 = exact)")
    batch_size: int = param(64, ge=1, help="samples per request")
    timeout: float = param(
        300.0, gt=0, help="seconds one request may take in all (connect, send the batch, read its scores)"
    )
    max_answer_mb: float = param(256.0, gt=0, help="a larger answer is refused unread")
    retries: int = param(
        3, ge=0, help="retries of a request that failed to arrive (no connection, timeout, HTTP 429/5xx)"
    )
    backoff: float = param(1.0, ge=0, help="seconds before the first retry; doubled for each next one")
    _served: dict = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        raw = post(
            self.url.rstrip("/") + "/health",
            None,
            headers=self._headers(),
            timeout=min(self.timeout, 30.0),
            retries=self.retries,
            backoff=self.backoff,
            what="remote reward",
            limit=1 << 20,
        )
        try:
            self._served = json.loads(raw)
            served = self._served["reward"]
        except (ValueError, KeyError, TypeError):
            raise ServiceError(
                f"remote reward: {self.url} is not fgrpo serve-reward (health answer {raw[:200]!r})"
            ) from None
        if self.serves is not None and served != self.serves:
            raise ServiceError(f"reward.serves: {self.url} serves {served!r}, not {self.serves!r}")

    @property
    def accepts_sources(self) -> bool:
        """Whether the served reward compares outputs with their source images (it then gets them)."""
        return bool(self._served.get("accepts_sources"))

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/octet-stream"}
        token = token_from_env(self.token_env)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def __call__(
        self,
        outputs: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        sources: Sequence[Any] | None = None,
    ) -> RewardResult:
        metas = list(metadata) if metadata else [{} for _ in prompts]
        parts = []
        for start in range(0, len(prompts), self.batch_size):
            stop = start + self.batch_size
            part = None if sources is None else sources[start:stop]
            body = encode_request(outputs[start:stop], prompts[start:stop], metas[start:stop], self.wire, part)
            raw = post(
                self.url.rstrip("/") + "/score",
                body,
                headers=self._headers(),
                timeout=self.timeout,
                retries=self.retries,
                backoff=self.backoff,
                what=f"remote reward {self._served.get('reward')}",
                limit=int(self.max_answer_mb * 2**20),
            )
            try:
                parts.append(decode_result(raw))
            except Exception as exc:
                raise ServiceError(
                    f"remote reward: {self.url} answered something that is not a reward result ({exc})"
                ) from None
        return _concat(parts)


def _concat(parts: list[RewardResult]) -> RewardResult:
    if len(parts) == 1:
        return parts[0]
    details: dict[str, Any] = {}
    for key in parts[0].details:
        values = [p.details[key] for p in parts]
        details[key] = (
            torch.cat(values) if isinstance(values[0], torch.Tensor) else [v for chunk in values for v in chunk]
        )
    return RewardResult(scores=torch.cat([p.scores for p in parts]), details=details)
