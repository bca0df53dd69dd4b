"""``remote``: score with a reward that runs in another process or on another machine, and the
server side, ``fgrpo serve-reward NAME``, which serves any registered reward over HTTP.

One GPU box can host a big reward model (a VLM judge, GenEval's detector) for many trainers. The
wire format is safetensors both ways, so nothing is unpickled: a request holds the ``outputs``
tensor (uint8 images by default: 4x fewer bytes than float32, and what image rewards convert to
anyway) with the prompts and metadata as JSON in the safetensors header; the answer holds
``scores`` and the tensor details, other details as JSON. The standard library's HTTP server and
client, no other dependency.

Edits: a served reward that compares outputs with their sources (``accepts_sources``: image
similarity, an edit judge) says so in ``/health``; the client then takes the sources from the
trainer and sends them with each batch (tensors ``source/i/k`` on the same wire).

The server binds 127.0.0.1 by default. Bound to any other address it refuses to start without a
shared token (an environment variable, never a command-line argument that ``ps`` shows); with a
token every request must carry ``Authorization: Bearer <token>``. Requests larger than
``--max-request-mb`` are refused before they are read. Reward calls are serialised (one model,
one device); HTTP parsing runs in threads.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import sys
import threading
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
    outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]], wire: str,
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
        header = {"prompts": json.dumps([str(p) for p in prompts]), "metadata": json.dumps([dict(m) for m in metadata]), "wire": used}
    except TypeError as exc:
        raise ValueError(f"remote: prompts and metadata travel as JSON: {exc}") from None
    if sources is not None:
        header["sources"] = json.dumps([len(row) for row in sources])
    return save(tensors, metadata=header)


def decode_request(body: bytes) -> tuple[torch.Tensor, list[str], list[dict[str, Any]], list[tuple[torch.Tensor, ...]] | None]:
    """(outputs, prompts, metadata, sources or None); raises ValueError on anything that is not a
    well-formed request."""
    from safetensors.torch import load

    tensors = load(body)
    header = _header(body)
    if "outputs" not in tensors or header is None or any(k != "outputs" and not k.startswith("source/") for k in tensors):
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
            sources = [tuple(tensors[f"source/{i}/{k}"].float() / scale for k in range(c)) for i, c in enumerate(counts)]
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
    timeout: float = param(300.0, gt=0, help="seconds to wait for one batch's scores")
    retries: int = param(3, ge=0, help="retries of a request that failed to arrive (no connection, timeout, HTTP 429/5xx)")
    backoff: float = param(1.0, ge=0, help="seconds before the first retry; doubled for each next one")
    _served: dict = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        raw = post(self.url.rstrip("/") + "/health", None, headers=self._headers(), timeout=min(self.timeout, 30.0),
                   retries=self.retries, backoff=self.backoff, what="remote reward")
        try:
            self._served = json.loads(raw)
            served = self._served["reward"]
        except (ValueError, KeyError, TypeError):
            raise ServiceError(f"remote reward: {self.url} is not fgrpo serve-reward (health answer {raw[:200]!r})") from None
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
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]], sources: Sequence[Any] | None = None
    ) -> RewardResult:
        metas = list(metadata) if metadata else [{} for _ in prompts]
        parts = []
        for start in range(0, len(prompts), self.batch_size):
            stop = start + self.batch_size
            part = None if sources is None else sources[start:stop]
            body = encode_request(outputs[start:stop], prompts[start:stop], metas[start:stop], self.wire, part)
            raw = post(self.url.rstrip("/") + "/score", body, headers=self._headers(), timeout=self.timeout,
                       retries=self.retries, backoff=self.backoff, what=f"remote reward {self._served.get('reward')}")
            try:
                parts.append(decode_result(raw))
            except Exception as exc:
                raise ServiceError(f"remote reward: {self.url} answered something that is not a reward result ({exc})") from None
        return _concat(parts)


def _concat(parts: list[RewardResult]) -> RewardResult:
    if len(parts) == 1:
        return parts[0]
    details: dict[str, Any] = {}
    for key in parts[0].details:
        values = [p.details[key] for p in parts]
        details[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else [v for chunk in values for v in chunk]
    return RewardResult(scores=torch.cat([p.scores for p in parts]), details=details)


# --- the server --------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], reward: Any, name: str, params: Mapping[str, Any], token: str | None, max_bytes: int):
        super().__init__(address, RewardHandler)
        self.reward, self.name, self.params = reward, name, dict(params)
        self.token, self.max_bytes = token, max_bytes
        self.lock = threading.Lock()


class RewardHandler(BaseHTTPRequestHandler):
    server: RewardServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def _authorised(self) -> bool:
        if self.server.token is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.server.token}".encode()):
            return True
        self._json(401, {"error": "missing or wrong token (Authorization: Bearer ...)"})
        return False

    def do_GET(self) -> None:
        if not self._authorised():
            return
        if self.path != "/health":
            return self._json(404, {"error": f"unknown path {self.path}; POST /score, GET /health"})
        accepts = bool(getattr(self.server.reward, "accepts_sources", False))
        self._json(200, {"reward": self.server.name, "params": self.server.params, "accepts_sources": accepts})

    def do_POST(self) -> None:
        if not self._authorised():
            return
        if self.path != "/score":
            return self._json(404, {"error": f"unknown path {self.path}; POST /score, GET /health"})
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            return self._json(411, {"error": "a Content-Length is required"})
        if int(length) > self.server.max_bytes:
            self.close_connection = True
            return self._json(413, {"error": f"request of {int(length)} bytes; the limit is {self.server.max_bytes} (--max-request-mb)"})
        body = self.rfile.read(int(length))
        try:
            outputs, prompts, metadata, sources = decode_request(body)
        except Exception as exc:
            return self._json(400, {"error": f"bad request: {exc}"})
        extra = {}
        if getattr(self.server.reward, "accepts_sources", False):
            extra["sources"] = sources if sources is not None else [()] * len(prompts)
        try:
            with self.server.lock:
                result = self.server.reward(outputs, prompts, metadata, **extra)
            payload = encode_result(result)
        except Exception as exc:  # the reward's own error, sent to the trainer that asked
            log.warning("reward %s failed: %s", self.server.name, exc)
            return self._json(500, {"error": f"reward {self.server.name!r} failed: {type(exc).__name__}: {exc}"})
        self._send(200, payload, "application/octet-stream")

    def _json(self, status: int, data: Any) -> None:
        self._send(status, json.dumps(data).encode(), "application/json")

    def _send(self, status: int, payload: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def make_server(name: str, params: Mapping[str, Any], host: str, port: int, token: str | None, max_bytes: int) -> RewardServer:
    from fgrpo.core import registry
    from fgrpo.core.config import ConfigError, RecipeError

    if token is None and not is_loopback(host):
        raise RecipeError([ConfigError("--host", f"got {host!r}, reachable from other machines; set a shared token in ${TOKEN_ENV} (or --token-env NAME) first")])
    reward = registry.create("reward", name, **params)
    return RewardServer((host, port), reward, name, params, token, max_bytes)


def serve(args: Any) -> int:
    """``fgrpo serve-reward``: build the reward once, then answer until interrupted."""
    import yaml

    from fgrpo.core.config import ConfigError, RecipeError

    params, errors = {}, []
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            errors.append(ConfigError("--set", f"got {item!r}; expected KEY=VALUE"))
            continue
        params[key] = yaml.safe_load(value)
    if errors:
        raise RecipeError(errors)
    token = token_from_env(args.token_env)
    server = make_server(args.name, params, args.host, args.port, token, int(args.max_request_mb * 2**20))
    host, port = server.server_address[:2]
    guard = "token required" if token else "no token: this machine only"
    print(f"serving reward {args.name!r} on http://{host}:{port} ({guard})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
