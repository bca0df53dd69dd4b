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

The server reads a request's header first (:func:`read_header`: every tensor's dtype, shape and
offsets checked against the body's size, so what it decodes to is known before the rest
arrives), then views its tensors in the body (:func:`open_request`, no copy) until they are
written as float32 into the reward's batch (:func:`to_float`).
"""

from __future__ import annotations

import json
import logging
import math
import sys
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


#: the dtypes a request's tensors may travel in, by their safetensors names
DTYPES = {"U8": torch.uint8, "F16": torch.float16, "F32": torch.float32}
#: a request's safetensors header (its prompts and metadata as JSON) at most: a batch's needs a
#: few hundred kB, and parsing JSON takes many times its size in Python objects
MAX_HEADER_BYTES = 16 << 20
#: what each element of a request costs once decoded: the reward gets float32
DECODED_ITEMSIZE = 4


@attrs.frozen
class RequestHeader:
    """A request's safetensors header, checked against the body's size: each tensor's dtype,
    shape and place (``begin``, ``end`` from ``start``), and the header's string metadata."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]
    metadata: dict[str, str]
    start: int

    @property
    def decoded_bytes(self) -> int:
        """What the tensors take as the float32 the reward is given."""
        return DECODED_ITEMSIZE * sum(math.prod(shape) for _, shape, _, _ in self.tensors.values())

    def largest(self) -> str:
        name, (_, shape, _, _) = max(self.tensors.items(), key=lambda item: math.prod(item[1][1]))
        return f"{name} {tuple(shape)}"


def header_length(prefix: bytes | bytearray, size: int) -> int:
    """The header's length from the first 8 bytes of a ``size``-byte safetensors body."""
    if size < 8:
        raise ValueError(f"a safetensors body has at least 8 bytes, got {size}")
    length = int.from_bytes(prefix[:8], "little")
    if length > size - 8:
        raise ValueError(f"the safetensors header claims {length} bytes of a {size}-byte body")
    return length


def read_header(raw: bytes | bytearray, size: int) -> RequestHeader:
    """The header ``raw`` of a ``size``-byte request body, every tensor's dtype, shape and offsets
    checked against each other and the body's size; raises ValueError."""
    parsed = json.loads(raw)
    if not isinstance(parsed, dict):
        raise ValueError("the safetensors header is not a JSON object")
    metadata = parsed.pop("__metadata__", None)
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise ValueError("expected prompts/metadata as strings in the safetensors header's __metadata__")
    if "outputs" not in parsed or any(k != "outputs" and not k.startswith("source/") for k in parsed):
        raise ValueError("expected a safetensors body with one tensor 'outputs' (and sources 'source/i/k')")
    tensors = {name: _tensor_entry(name, entry) for name, entry in parsed.items()}
    end = 0
    for name, (_, _, begin, stop) in sorted(tensors.items(), key=lambda item: item[1][2:]):
        if begin != end:
            raise ValueError(f"tensor {name!r} starts at byte {begin}, expected {end} (tensors are packed)")
        end = stop
    start = 8 + len(raw)
    if start + end != size:
        raise ValueError(f"the tensors take {end} bytes, the body has {size - start} after its header")
    return RequestHeader(tensors, metadata, start)


def _tensor_entry(name: str, entry: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        got = entry.get("dtype") if isinstance(entry, dict) else entry
        raise ValueError(f"tensor {name!r}: dtype {str(got)[:40]!r}; expected one of {', '.join(DTYPES)}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) <= 8 and all(_natural(n) for n in shape)):
        raise ValueError(f"tensor {name!r}: shape {str(shape)[:80]}; expected at most 8 sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(n) for n in offsets)):
        raise ValueError(f"tensor {name!r}: data_offsets {str(offsets)[:80]}; expected [begin, end]")
    dtype, (begin, end) = DTYPES[entry["dtype"]], offsets
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"tensor {name!r}: {end - begin} bytes for shape {tuple(shape)} of {entry['dtype']}")
    return dtype, tuple(shape), begin, end


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@attrs.define
class WireRequest:
    """A request as it came: its tensors are views of the body in their wire dtype (the body lives
    as long as they do); :func:`to_float` gives the reward's floats."""

    outputs: torch.Tensor
    prompts: list[str]
    metadata: list[dict[str, Any]]
    sources: list[tuple[torch.Tensor, ...]] | None
    scale: float

    @property
    def n(self) -> int:
        return len(self.prompts)


def open_request(body: bytearray, header: RequestHeader) -> WireRequest:
    """The request ``body`` (whose header is ``header``), its tensors viewed in place, not copied;
    raises ValueError on anything that is not a well-formed request."""
    views = {name: _view(body, header.start, entry) for name, entry in header.tensors.items()}
    outputs = views["outputs"]
    n = outputs.shape[0] if outputs.dim() else -1
    prompts = json.loads(header.metadata.get("prompts", "null"))
    metadata = json.loads(header.metadata.get("metadata", "null"))
    if not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts) and len(prompts) == n):
        raise ValueError(f"expected {n} prompts (strings), got {str(prompts)[:200]}")
    if not (isinstance(metadata, list) and all(isinstance(m, dict) for m in metadata) and len(metadata) == n):
        raise ValueError(f"expected {n} metadata objects, got {str(metadata)[:200]}")
    sources = None
    if "sources" in header.metadata:
        counts = json.loads(header.metadata["sources"])
        if not (isinstance(counts, list) and len(counts) == n and all(_natural(c) for c in counts)):
            raise ValueError(f"expected {n} source counts, got {str(counts)[:200]}")
        try:
            sources = [tuple(views[f"source/{i}/{k}"] for k in range(c)) for i, c in enumerate(counts)]
        except KeyError as exc:
            raise ValueError(f"a source image the header announces is missing: {exc}") from None
    scale = 255.0 if header.metadata.get("wire") == "uint8" else 1.0
    return WireRequest(outputs, prompts, metadata, sources, scale)


def _view(body: bytearray, start: int, entry: tuple[torch.dtype, tuple[int, ...], int, int]) -> torch.Tensor:
    dtype, shape, begin, end = entry
    if begin == end:  # frombuffer refuses an empty tensor
        return torch.empty(shape, dtype=dtype)
    tensor = torch.frombuffer(body, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=start + begin)
    if sys.byteorder == "big":  # safetensors is little-endian
        tensor = torch.from_numpy(tensor.numpy().byteswap())
    return tensor.view(shape)


def to_float(wire: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``wire`` / ``scale`` as float32, written into ``out`` when given (a slice of a batch)."""
    out = torch.empty(wire.shape, dtype=torch.float32) if out is None else out
    out.copy_(wire)
    return out.div_(scale) if scale != 1.0 else out


def decode_request(
    body: bytes | bytearray,
) -> tuple[torch.Tensor, list[str], list[dict[str, Any]], list[tuple[torch.Tensor, ...]] | None]:
    """(outputs, prompts, metadata, sources or None) as the reward gets them (float32); raises
    ValueError on anything that is not a well-formed request."""
    buffer = body if isinstance(body, bytearray) else bytearray(body)  # frombuffer wants it writable
    length = header_length(buffer, len(buffer))
    request = open_request(buffer, read_header(buffer[8 : 8 + length], len(buffer)))
    sources = request.sources
    if sources is not None:
        sources = [tuple(to_float(s, request.scale) for s in row) for row in sources]
    return to_float(request.outputs, request.scale), request.prompts, request.metadata, sources


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
