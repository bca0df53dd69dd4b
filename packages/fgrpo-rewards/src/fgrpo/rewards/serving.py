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
  most ``max_bytes`` (413), and fit in the ``max_inflight_bytes`` all requests being read or
  scored share (else 503 with ``Retry-After``, which ``remote`` retries), all checked before a
  byte of the body is read; a body is held only as it arrives;
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
from fgrpo.rewards.remote import TOKEN_ENV, decode_request, encode_result

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
    outputs: torch.Tensor
    prompts: list[str]
    metadata: list[dict[str, Any]]
    done: concurrent.futures.Future
    sources: list[tuple[torch.Tensor, ...]] | None = None  # edits: each sample's source images
    batch: dict[str, int] = attrs.Factory(dict)  # what it was scored with, for the log line

    @property
    def n(self) -> int:
        return len(self.prompts)


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
        batch_size: int | None = None,
    ):
        self.socket, self.reward, self.name, self.params = sock, reward, name, dict(params)
        self.token = f"Bearer {token}".encode() if token else None
        self.max_bytes, self.max_connections, self.read_timeout_s = max_bytes, max_connections, read_timeout_s
        self.max_inflight_bytes = max(max_inflight_bytes or 2 * max_bytes, max_bytes)
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

    # --- one connection --------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        start = time.monotonic()
        peer = writer.get_extra_info("peername") or ("?", 0)
        client = f"[{peer[0]}]:{peer[1]}" if ":" in str(peer[0]) else f"{peer[0]}:{peer[1]}"
        what, size, status, note = "-", 0, 0, ""
        self._open += 1
        reserved = 0
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
                what = f"{method} {path}"
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
                    status, payload, kind = 200, json.dumps(health).encode(), "application/json"
                else:
                    size = reserved = self._admit(headers)
                    self._inflight += reserved
                    if headers.get("expect", b"").lower() == b"100-continue":  # curl asks before a large body
                        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    body = await self._body(reader, size, deadline)
                    payload, batch = await self._score(body)
                    del body
                    status, kind = 200, "application/octet-stream"
                    if batch.get("requests", 1) > 1:
                        note = f" (scored with {batch['requests'] - 1} other request(s): {batch['samples']} samples)"
                await self._send(writer, status, payload, kind, deadline)
            except _Answer as answer:
                status, note = answer.status, ""
                message = json.dumps({"error": answer.message}).encode()
                await self._send(
                    writer, answer.status, message, "application/json", self._now() + LINGER_S, answer.retry_after
                )
                if answer.status != 408:  # a slow client is not waited for again
                    await self._linger(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            status = status or 499  # the client went away
        finally:
            self._open -= 1
            self._inflight -= reserved
            writer.close()
            ms = 1000 * (time.monotonic() - start)
            log.info("%s %s %d bytes -> %s in %.1f ms%s", client, what, size, status, ms, note)

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
            raise _Answer(
                503,
                f"the server is busy: {self._inflight} bytes of requests are being read or scored "
                f"(--max-inflight-mb); retry",
                1,
            )
        return size

    async def _body(self, reader: asyncio.StreamReader, size: int, deadline: float) -> bytes:
        body = bytearray()
        try:
            while len(body) < size:
                chunk = await asyncio.wait_for(
                    reader.read(min(MiB, size - len(body))), max(0.0, deadline - self._now())
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
        return bytes(body)

    async def _score(self, body: bytes) -> tuple[bytes, dict[str, int]]:
        """The encoded result of the request ``body``, and what it was scored with, once the
        reward's thread has scored it (with the other requests waiting then)."""
        loop = asyncio.get_running_loop()  # the server's own loop (self._loop)
        try:
            outputs, prompts, metadata, sources = await loop.run_in_executor(self._decoders, decode_request, body)
        except Exception as exc:  # noqa: BLE001 - any malformed body
            raise _Answer(400, f"bad request: {exc}") from None
        done: concurrent.futures.Future = concurrent.futures.Future()
        job = _Job(outputs, prompts, metadata, done, sources)
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
            groups: dict[tuple, list[_Job]] = {}
            for job in batch:  # outputs of another shape cannot be concatenated: scored apart
                groups.setdefault((tuple(job.outputs.shape[1:]), job.outputs.dtype), []).append(job)
            for jobs in groups.values():
                self._score_group(jobs)

    def _score_group(self, jobs: list[_Job]) -> None:
        sizes = [job.n for job in jobs]
        try:
            outputs = torch.cat([job.outputs for job in jobs]) if len(jobs) > 1 else jobs[0].outputs
            prompts = [p for job in jobs for p in job.prompts]
            metadata = [m for job in jobs for m in job.metadata]
            extra = {}
            if getattr(self.reward, "accepts_sources", False):  # edits: the sources the client sent (none: empty)
                extra["sources"] = [
                    s for job in jobs for s in (job.sources if job.sources is not None else [()] * job.n)
                ]
            result = self.reward(outputs, prompts, metadata, **extra)
            payloads = [encode_result(part) for part in split_result(result, sizes)]
        except Exception as exc:  # the reward's own error, sent to every trainer that asked
            log.warning("reward %s failed on %d samples of %d request(s): %s", self.name, sum(sizes), len(jobs), exc)
            for job in jobs:
                job.done.set_result((500, f"reward {self.name!r} failed: {type(exc).__name__}: {exc}"))
            return
        for job, payload in zip(jobs, payloads, strict=True):
            job.batch.update(requests=len(jobs), samples=sum(sizes))
            job.done.set_result((200, payload))


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
