"""``fgrpo serve-reward NAME``: one reward model served over HTTP to many training processes.

The wire format is :mod:`fgrpo.rewards.remote`'s (safetensors both ways: ``POST /score``,
``GET /health``). The server binds 127.0.0.1 by default; bound to any other address it refuses to
start without a shared token (an environment variable, never an argument ``ps`` shows), and then
every request must carry ``Authorization: Bearer <token>``.

It holds under load and against hostile clients:

- one asyncio event loop reads every connection, so idle, slow or half-open clients cost no
  thread; at most ``max_connections`` are open at once (more are answered 503 at once; the
  process's descriptor limit is raised to allow them);
- a request (head and body) must arrive within ``read_timeout_s`` of its connection (408), and
  its answer must be taken within the same time: a client trickling a byte a second is cut off;
- the head is at most 64 KiB (431); ``Content-Length`` must be a plain decimal number (400), at
  most ``max_bytes`` (413), and fit in the ``max_inflight_bytes`` all requests being read,
  decoded or scored share (else 503 with ``Retry-After``, which ``remote`` retries), all checked
  before a byte of the body is read; a body is held only as it arrives;
- the body's safetensors header comes first: the float32 its tensors decode to (their declared
  shapes, 4 bytes an element: what the reward is given) must be at most ``max_decoded_bytes``
  (413) and fit in the same in-flight budget beside the wire bytes (503), checked before the rest
  of the body is read. Decoding copies nothing: the tensors are views of the body until the
  reward's thread writes them, as floats, into its batch, and the body is dropped once copied, so
  a request holds its wire bytes plus its floats at most (it held 6x its size before, twice that
  with a reward's own copies);
- one log line per request: the client, what it asked, its size, the status and the time;
- one worker thread calls the reward (one model, one device) and takes every request waiting
  when it is free, up to ``batch_size`` samples together: training processes that ask at the
  same time are scored in one batch, each getting its own samples' scores and details back.
  Requests whose outputs do not stack (another image size) are scored apart.

The standard library only: neither uvicorn nor aiohttp bounds the time a request takes to arrive
(their timeouts are for idle keep-alive connections), which is the deadline this server needs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import hmac
import ipaddress
import json
import logging
import re
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

import attrs
import torch

from fgrpo.core.protocols import RewardResult
from fgrpo.rewards.remote import (
    MAX_HEADER_BYTES,
    TOKEN_ENV,
    RequestHeader,
    WireRequest,
    encode_result,
    header_length,
    open_request,
    read_header,
    to_float,
)

log = logging.getLogger("fgrpo.rewards.remote")

MiB = 1 << 20
HEAD_LIMIT = 64 * 1024
LINGER_S = 1.0  # how long an answered connection's unread request is drained before closing
DECIMAL = re.compile(rb"[0-9]{1,18}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@attrs.define
class _Job:
    request: WireRequest | None  # taken by the reward's thread when scored (its body goes with it)
    n: int
    shape: tuple[int, ...]  # of one sample: requests of the same shape are scored together
    done: concurrent.futures.Future
    batch: dict[str, int] = attrs.Factory(dict)  # what it was scored with, for the log line


@attrs.define
class _Exchange:
    """One connection as its log line tells it, and the in-flight bytes its request holds."""

    what: str = "-"
    size: int = 0
    status: int = 0
    note: str = ""
    held: int = 0


class _Answer(Exception):
    """An HTTP answer decided while reading the request (an error, or a busy server)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class RewardServer:
    """The server of one reward: bound when made, serving from :meth:`serve_forever` (in the thread
    that calls it) until :meth:`shutdown` (from any thread)."""

    def __init__(
        self,
        sock: socket.socket,
        reward: Any,
        name: str,
        params: Mapping[str, Any],
        token: str | None,
        *,
        max_bytes: int,
        max_connections: int = 512,
        read_timeout_s: float = 30.0,
        max_inflight_bytes: int | None = None,
        max_decoded_bytes: int = 1024 * MiB,
        batch_size: int | None = None,
    ):
        self.socket, self.reward, self.name, self.params = sock, reward, name, dict(params)
        self.token = f"Bearer {token}".encode() if token else None
        self.max_bytes, self.max_connections, self.read_timeout_s = max_bytes, max_connections, read_timeout_s
        self.max_inflight_bytes = max(max_inflight_bytes or 2 * max_bytes, max_bytes)
        self.max_decoded_bytes = max_decoded_bytes
        own = getattr(reward, "batch_size", None)
        self.batch_size = batch_size or (own if isinstance(own, int) and own > 0 else 64)
        self.server_address = sock.getsockname()[:2]
        self._open = self._inflight = 0
        self._pending: collections.deque[_Job | None] = collections.deque()
        self._wake = threading.Condition()
        self._decoders = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="fgrpo-decode")
        self._worker = threading.Thread(target=self._score_batches, name="fgrpo-reward", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future | None = None
        self._stopped = threading.Event()

    # --- running ---------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        self._worker.start()
        try:
            asyncio.run(self._main())
        finally:
            with self._wake:
                self._pending.append(None)
                self._wake.notify()
            self._decoders.shutdown(wait=False)
            self._stopped.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = self._loop.create_future()
        server = await asyncio.start_server(self._connection, sock=self.socket, limit=HEAD_LIMIT)
        async with server:
            await self._stop

    def _now(self) -> float:
        """The serving loop's clock (the deadlines' time base)."""
        assert self._loop is not None  # set when serving starts
        return self._loop.time()

    def shutdown(self) -> None:
        """Stop serving (from another thread) and wait until :meth:`serve_forever` returns."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():

            def finish() -> None:
                if not stop.done():
                    stop.set_result(None)

            loop.call_soon_threadsafe(finish)
            self._stopped.wait(30)

    def server_close(self) -> None:
        self.socket.close()

    @property
    def inflight_bytes(self) -> int:
        """The wire and decoded bytes the requests being read, decoded or scored hold now."""
        return self._inflight

    # --- one connection --------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        start = time.monotonic()
        peer = writer.get_extra_info("peername") or ("?", 0)
        client = f"[{peer[0]}]:{peer[1]}" if ":" in str(peer[0]) else f"{peer[0]}:{peer[1]}"
        exchange = _Exchange()
        self._open += 1
        try:
            deadline = self._now() + self.read_timeout_s
            try:
                if self._open > self.max_connections:
                    raise _Answer(
                        503,
                        f"the server is busy: {self.max_connections} connections are open (--max-connections); retry",
                        1,
                    )
                method, path, headers = await self._head(reader, deadline)
                exchange.what = f"{method} {path}"
                if self.token is not None and not hmac.compare_digest(headers.get("authorization", b""), self.token):
                    raise _Answer(401, "missing or wrong token (Authorization: Bearer ...)")
                if path not in ("/score", "/health"):
                    raise _Answer(404, f"unknown path {path}; POST /score, GET /health")
                if (method, path) not in (("POST", "/score"), ("GET", "/health")):
                    raise _Answer(405, f"{method} {path} is not served; POST /score, GET /health")
                if path == "/health":
                    health = {
                        "reward": self.name,
                        "params": self.params,
                        "accepts_sources": bool(getattr(self.reward, "accepts_sources", False)),
                    }
                    exchange.status, payload, kind = 200, json.dumps(health).encode(), "application/json"
                else:
                    payload, batch = await self._scored(reader, writer, headers, deadline, exchange)
                    exchange.status, kind = 200, "application/octet-stream"
                    if batch.get("requests", 1) > 1:
                        exchange.note = (
                            f" (scored with {batch['requests'] - 1} other request(s): {batch['samples']} samples)"
                        )
                await self._send(writer, exchange.status, payload, kind, deadline)
            except _Answer as answer:
                exchange.status, exchange.note = answer.status, ""
                message = json.dumps({"error": answer.message}).encode()
                await self._send(
                    writer, answer.status, message, "application/json", self._now() + LINGER_S, answer.retry_after
                )
                if answer.status != 408:  # a slow client is not waited for again
                    await self._linger(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            exchange.status = exchange.status or 499  # the client went away
        finally:
            self._open -= 1
            self._inflight -= exchange.held
            writer.close()
            e, ms = exchange, 1000 * (time.monotonic() - start)
            log.info("%s %s %d bytes -> %s in %.1f ms%s", client, e.what, e.size, e.status, ms, e.note)

    async def _scored(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        headers: Mapping[str, bytes],
        deadline: float,
        exchange: _Exchange,
    ) -> tuple[bytes, dict[str, int]]:
        """The answer to a POST /score and what it was scored with. Its wire bytes are held in the
        in-flight budget before its body is read, its decoded bytes once its header has come, so a
        request that cannot fit is refused before the rest of it is read."""
        exchange.size = self._admit(headers)
        self._hold(exchange, exchange.size)
        if headers.get("expect", b"").lower() == b"100-continue":  # curl asks before a large body
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = bytearray()
        header = await self._read_header(reader, body, exchange.size, deadline)
        self._hold(exchange, self._admit_decoded(header, exchange.held))
        await self._read(reader, body, exchange.size, exchange.size, deadline)
        loop = asyncio.get_running_loop()  # the server's own loop (self._loop)
        try:
            request = await loop.run_in_executor(self._decoders, open_request, body, header)
        except Exception as exc:  # noqa: BLE001 - any malformed body
            raise _Answer(400, f"bad request: {exc}") from None
        del body  # the request's tensors are views of it: it goes when the reward's thread has their floats
        return await self._score(request)

    def _hold(self, exchange: _Exchange, size: int) -> None:
        self._inflight += size
        exchange.held += size

    async def _head(self, reader: asyncio.StreamReader, deadline: float) -> tuple[str, str, dict[str, bytes]]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), max(0.0, deadline - self._now()))
        except asyncio.TimeoutError:
            raise _Answer(
                408, f"the request did not arrive within {self.read_timeout_s:g} s (--read-timeout-s)"
            ) from None
        except asyncio.LimitOverrunError:
            raise _Answer(431, f"the request head is larger than {HEAD_LIMIT // 1024} KiB") from None
        except ValueError:  # asyncio's "chunk exceed the limit" when the separator is never found
            raise _Answer(431, f"the request head is larger than {HEAD_LIMIT // 1024} KiB") from None
        lines = head[:-4].split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            raise _Answer(400, "not an HTTP/1.x request")
        headers: dict[str, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            key = name.strip().lower().decode("latin-1")
            if not sep or not key or name != name.strip():
                raise _Answer(400, f"malformed header line {line[:80]!r}")
            if key in headers and key in ("content-length", "authorization", "transfer-encoding"):
                raise _Answer(400, f"{key} given twice")
            headers[key] = value.strip()
        return parts[0].decode("latin-1"), parts[1].decode("latin-1"), headers

    def _admit(self, headers: Mapping[str, bytes]) -> int:
        """The request's declared size, once it is allowed: before any of its body is read."""
        if "transfer-encoding" in headers:
            raise _Answer(411, "a Content-Length is required (chunked bodies are not accepted)")
        raw = headers.get("content-length")
        if raw is None:
            raise _Answer(411, "a Content-Length is required")
        if DECIMAL.fullmatch(raw) is None:
            raise _Answer(
                400, f"Content-Length must be a decimal number of bytes, got {raw.decode('utf-8', 'replace')!r}"
            )
        size = int(raw)
        if size > self.max_bytes:
            raise _Answer(413, f"request of {size} bytes; the limit is {self.max_bytes} (--max-request-mb)")
        if self._inflight and self._inflight + size > self.max_inflight_bytes:
            raise self._busy()
        return size

    def _admit_decoded(self, header: RequestHeader, held: int) -> int:
        """The bytes the request's tensors take once decoded, once they are allowed: before the
        rest of its body is read. A request alone is let in whatever the budget: it could never
        fit otherwise."""
        decoded = header.decoded_bytes
        if decoded > self.max_decoded_bytes:
            raise _Answer(
                413,
                f"request decoding to {decoded} bytes ({header.largest()} as float32); the limit is "
                f"{self.max_decoded_bytes} (--max-decoded-mb)",
            )
        if self._inflight > held and self._inflight + decoded > self.max_inflight_bytes:
            raise self._busy()
        return decoded

    def _busy(self) -> _Answer:
        return _Answer(
            503,
            f"the server is busy: {self._inflight} bytes of requests are being read, decoded or scored "
            f"(--max-inflight-mb); retry",
            1,
        )

    async def _read_header(
        self, reader: asyncio.StreamReader, body: bytearray, size: int, deadline: float
    ) -> RequestHeader:
        """The safetensors header at the start of a ``size``-byte body, read into ``body`` (and
        nothing after it) and checked."""
        try:
            await self._read(reader, body, min(8, size), size, deadline)
            length = header_length(body, size)
        except ValueError as exc:
            raise _Answer(400, f"bad request: {exc}") from None
        if length > MAX_HEADER_BYTES:
            raise _Answer(
                413, f"request header (prompts and metadata) of {length} bytes; the limit is {MAX_HEADER_BYTES}"
            )
        await self._read(reader, body, 8 + length, size, deadline)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._decoders, read_header, body[8:], size)
        except Exception as exc:  # noqa: BLE001 - any malformed header (deep JSON: a RecursionError)
            raise _Answer(400, f"bad request: {exc}") from None

    async def _read(
        self, reader: asyncio.StreamReader, body: bytearray, upto: int, size: int, deadline: float
    ) -> None:
        """Append what arrives to ``body`` until it holds ``upto`` bytes (of ``size``)."""
        try:
            while len(body) < upto:
                chunk = await asyncio.wait_for(
                    reader.read(min(MiB, upto - len(body))), max(0.0, deadline - self._now())
                )
                if not chunk:
                    raise asyncio.IncompleteReadError(b"", size)
                body += chunk
        except asyncio.TimeoutError:
            raise _Answer(
                408,
                f"the request did not arrive within {self.read_timeout_s:g} s (--read-timeout-s); "
                f"{len(body)} of {size} bytes came",
            ) from None

    async def _score(self, request: WireRequest) -> tuple[bytes, dict[str, int]]:
        """The encoded result of ``request``, and what it was scored with, once the reward's
        thread has scored it (with the other requests waiting then)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        job = _Job(request, request.n, tuple(request.outputs.shape[1:]), done)
        del request  # the job holds the body now; the reward's thread lets it go
        with self._wake:
            self._pending.append(job)
            self._wake.notify()
        status, payload = await asyncio.wrap_future(done)
        if status != 200:
            raise _Answer(status, payload)
        return payload, job.batch

    async def _send(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        payload: bytes,
        kind: str,
        deadline: float,
        retry_after: int | None = None,
    ) -> None:
        head = [
            f"HTTP/1.1 {status} {REASONS.get(status, '')}",
            f"Content-Type: {kind}",
            f"Content-Length: {len(payload)}",
            "Connection: close",
        ] + ([f"Retry-After: {retry_after}"] if retry_after else [])
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        try:
            await asyncio.wait_for(writer.drain(), max(0.0, deadline - self._now()))
        except asyncio.TimeoutError:  # a client that does not take its answer
            writer.transport.abort()

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Half-close, then drop what the client still sends for a moment: closing with its request
        unread would reset the connection and could lose the answer before the client reads it."""
        try:
            if writer.can_write_eof():
                writer.write_eof()
            end = self._now() + LINGER_S
            while await asyncio.wait_for(reader.read(256 * 1024), max(0.0, end - self._now())):
                pass
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass

    # --- the reward's thread -------------------------------------------------------------------

    def _take(self) -> list[_Job] | None:
        """The next batch: every waiting request, oldest first, up to ``batch_size`` samples (a
        request is never split; one larger than that goes alone)."""
        with self._wake:
            while not self._pending:
                self._wake.wait()
            if self._pending[0] is None:
                return None
            first = self._pending.popleft()
            assert first is not None  # checked above
            batch, samples = [first], first.n
            while self._pending and (job := self._pending[0]) is not None and samples + job.n <= self.batch_size:
                self._pending.popleft()
                batch.append(job)
                samples += job.n
            return batch

    def _score_batches(self) -> None:
        while (batch := self._take()) is not None:
            groups: dict[tuple[int, ...], list[_Job]] = {}
            for job in batch:  # outputs of another shape cannot be concatenated: scored apart
                groups.setdefault(job.shape, []).append(job)
            for jobs in groups.values():
                self._score_group(jobs)

    def _score_group(self, jobs: list[_Job]) -> None:
        sizes = [job.n for job in jobs]
        try:
            outputs, prompts, metadata, extra = _as_batch(jobs, getattr(self.reward, "accepts_sources", False))
            result = self.reward(outputs, prompts, metadata, **extra)
            del outputs, extra  # the batch's floats go before the answers are encoded
            payloads = [encode_result(part) for part in split_result(result, sizes)]
        except Exception as exc:  # the reward's own error, sent to every trainer that asked
            log.warning("reward %s failed on %d samples of %d request(s): %s", self.name, sum(sizes), len(jobs), exc)
            for job in jobs:
                job.done.set_result((500, f"reward {self.name!r} failed: {type(exc).__name__}: {exc}"))
            return
        for job, payload in zip(jobs, payloads, strict=True):
            job.batch.update(requests=len(jobs), samples=sum(sizes))
            job.done.set_result((200, payload))


def _as_batch(
    jobs: Sequence[_Job], with_sources: bool
) -> tuple[torch.Tensor, list[str], list[dict[str, Any]], dict[str, Any]]:
    """(outputs, prompts, metadata, the reward's other arguments) of the jobs' samples together,
    the outputs written as float32 straight into one batch: each job's body is let go once its
    samples are copied, so a request never holds more than its wire bytes and its floats (and no
    concatenation copies the floats again)."""
    outputs = torch.empty((sum(job.n for job in jobs), *jobs[0].shape), dtype=torch.float32)
    prompts: list[str] = []
    metadata: list[dict[str, Any]] = []
    sources: list[tuple[torch.Tensor, ...]] = []
    at = 0
    for job in jobs:
        request, job.request = job.request, None
        assert request is not None  # a job is scored once
        to_float(request.outputs, request.scale, out=outputs[at : at + job.n])
        prompts += request.prompts
        metadata += request.metadata
        if with_sources:  # edits: the sources the client sent (none: empty)
            rows = request.sources if request.sources is not None else [()] * job.n
            sources += [tuple(to_float(image, request.scale) for image in row) for row in rows]
        at += job.n
        del request  # the last view of the job's body
    return outputs, prompts, metadata, ({"sources": sources} if with_sources else {})


def split_result(result: RewardResult, sizes: Sequence[int]) -> list[RewardResult]:
    """One batch's result as the results of its requests (``sizes`` samples each): scores and
    per-sample details (tensors along their first dimension, lists) split; anything else shared."""
    total = sum(sizes)
    scores = torch.as_tensor(result.scores)
    if scores.dim() != 1 or scores.shape[0] != total:
        raise ValueError(f"returned scores of shape {tuple(scores.shape)} for {total} samples")
    parts = [RewardResult(scores=s, details={}) for s in scores.split(list(sizes))]
    for key, value in result.details.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == total:
            pieces: list[Any] = list(value.split(list(sizes)))
        elif isinstance(value, (list, tuple)) and len(value) == total:
            offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            pieces = [list(value[a:b]) for a, b in pairwise(offsets)]
        else:
            pieces = [value] * len(sizes)
        for part, piece in zip(parts, pieces, strict=True):
            part.details[key] = piece
    return parts


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (IPv4 or IPv6), or a RecipeError naming the option."""
    from fgrpo.core.config import ConfigError, RecipeError

    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        return socket.create_server(address[:2], family=family, backlog=256)
    except socket.gaierror as exc:
        raise RecipeError([ConfigError("--host", f"cannot listen on {host!r}: {exc.strerror}")]) from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            shown = f"[{host}]" if ":" in host else host
            raise RecipeError(
                [
                    ConfigError(
                        "--port",
                        f"{shown}:{port} is in use (another server?); choose another port, or 0 for any free one",
                    )
                ]
            ) from None
        raise RecipeError([ConfigError("--host", f"cannot listen on {host!r} port {port}: {exc.strerror}")]) from None


def make_server(
    name: str, params: Mapping[str, Any], host: str, port: int, token: str | None, max_bytes: int, **options: Any
) -> RewardServer:
    """Check the token rule, bind, then build the reward (which may take minutes): a port in use is
    known at once. ``options``: :class:`RewardServer`'s limits."""
    from fgrpo.core import registry
    from fgrpo.core.config import ConfigError, RecipeError

    if token is None and not is_loopback(host):
        raise RecipeError(
            [
                ConfigError(
                    "--host",
                    f"got {host!r}, reachable from other machines; set a shared token in ${TOKEN_ENV} (or --token-env "
                    f"NAME) first",
                )
            ]
        )
    sock = _listen(host, port)
    try:
        reward = registry.create("reward", name, **params)
    except BaseException:
        sock.close()
        raise
    if "max_connections" in options:
        options["max_connections"] = _descriptors_for(options["max_connections"])
    return RewardServer(sock, reward, name, params, token, max_bytes=max_bytes, **options)


def _descriptors_for(connections: int) -> int:
    """``connections``, once the process may open that many sockets (its soft descriptor limit is
    raised toward the hard one); fewer, said in one log line, when the hard limit is lower."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + 64  # the reward's own files, the listening socket ...
    if soft != resource.RLIM_INFINITY and soft < wanted:
        top = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
            soft = top
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning(
            "--max-connections %d lowered to %d: this process may open %d files (ulimit -n)",
            connections,
            soft - 64,
            soft,
        )
        return max(1, soft - 64)
    return connections


def reward_params(overrides: Sequence[str]) -> dict[str, Any]:
    """The reward's parameters from ``--set KEY=VALUE`` items, each VALUE plain YAML (no tags);
    raises RecipeError with one line per bad item."""
    from fgrpo.core.config import ConfigError, RecipeError, shown
    from fgrpo.core.yaml_reading import read_yaml

    params, errors = {}, []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            errors.append(ConfigError("--set", f"got {item!r}; expected KEY=VALUE"))
            continue
        try:
            params[key] = read_yaml(value, f"--set {key}")
        except RecipeError as exc:
            problems = "; ".join(error.message for error in exc.errors)
            errors.append(
                ConfigError(
                    f"--set {key}",
                    f"got {shown(value)}: {problems}; expected a plain YAML value (a number, a string, true or "
                    f"false, [a, list], {{a: mapping}})",
                )
            )
    if errors:
        raise RecipeError(errors)
    return params


def serve(args: Any) -> int:
    """``fgrpo serve-reward``: build the reward once, then answer until interrupted."""
    from fgrpo.rewards.http import token_from_env

    params = reward_params(args.overrides)
    if not log.handlers and not logging.getLogger().handlers:  # one line per request on stderr
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    token = token_from_env(args.token_env)
    server = make_server(
        args.name,
        params,
        args.host,
        args.port,
        token,
        int(args.max_request_mb * MiB),
        max_connections=args.max_connections,
        read_timeout_s=args.read_timeout_s,
        max_inflight_bytes=int(args.max_inflight_mb * MiB),
        max_decoded_bytes=int(args.max_decoded_mb * MiB),
        batch_size=args.batch_size,
    )
    host, port = server.server_address
    shown = f"[{host}]" if ":" in host else host
    guard = "token required" if token else "no token: this machine only"
    print(
        f"serving reward {args.name!r} on http://{shown}:{port} ({guard}; batches of up to {server.batch_size} "
        f"samples)",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
