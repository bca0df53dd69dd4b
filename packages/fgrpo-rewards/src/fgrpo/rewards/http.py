"""A small HTTP client for rewards served elsewhere (``vlm-judge``, ``remote``): the standard
library only, retries with exponential backoff on what a retry can fix (no connection, a
timeout, HTTP 429/502/503/504), one clear error for the rest.

``timeout`` is a total deadline for each request: connecting, sending and every read of the
answer together. A socket timeout alone bounds each read, so a server trickling one byte a second
could hold a 5 s call for minutes; here one watcher thread (:class:`_Deadlines`) shuts the socket
down when the request's time is up, whatever it is waiting for. Answers are read up to a size
cap (``limit``) and refused past it, before they fill memory. Proxies are taken from the
environment (``http_proxy``, ``https_proxy``, ``no_proxy``) as urllib does.
"""

from __future__ import annotations

import base64
import functools
import heapq
import http.client
import itertools
import json
import logging
import os
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from fgrpo.core.registry import ComponentError

log = logging.getLogger(__name__)

RETRY_STATUS = (429, 502, 503, 504)
MiB = 1 << 20
#: the largest answer read when the caller gives no limit
DEFAULT_LIMIT = 64 * MiB


class ServiceError(ComponentError):
    """A reward service failed (unreachable, refused, or answered something unusable)."""


def token_from_env(name: str | None) -> str | None:
    """Secrets come from the environment, never from a recipe (recipes are logged and copied)."""
    return os.environ.get(name) or None if name else None


# --- deadlines -----------------------------------------------------------------------------------


class _Deadlines:
    """One daemon thread that shuts down each watched socket at its deadline (a blocked connect,
    send or read then returns at once), for every request of the process."""

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._heap: list[tuple[float, int, socket.socket]] = []
        self._cancelled: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, sock: socket.socket, deadline: float) -> int:
        with self._wake:
            ident = next(self._ids)
            heapq.heappush(self._heap, (deadline, ident, sock))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fgrpo-http-deadlines", daemon=True)
                self._thread.start()
            self._wake.notify()
            return ident

    def cancel(self, ident: int) -> None:
        with self._wake:
            self._cancelled.add(ident)
            self._wake.notify()

    def _run(self) -> None:
        with self._wake:
            while True:
                while self._heap and self._heap[0][1] in self._cancelled:
                    self._cancelled.discard(heapq.heappop(self._heap)[1])
                if not self._heap:
                    self._wake.wait()
                    continue
                deadline, ident, sock = self._heap[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
                heapq.heappop(self._heap)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # already closed
                    pass


_DEADLINES = _Deadlines()


class _Watched:
    """A connection of one request: its socket is watched from the moment it connects, until the
    request's deadline."""

    def __init__(self, *args: Any, deadline: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.deadline = deadline
        self.watches: list[int] = []  # this connection's watch ids

    def connect(self) -> None:
        # a mixin of http.client.HTTPConnection (_HTTP, _HTTPS below): connect() and sock are its
        super().connect()  # type: ignore[misc]
        sock: Any = self.sock  # type: ignore[attr-defined]
        sock.settimeout(max(0.001, self.deadline - time.monotonic()))
        self.watches.append(_DEADLINES.watch(sock, self.deadline))


class _HTTP(_Watched, http.client.HTTPConnection):
    pass


class _HTTPS(_Watched, http.client.HTTPSConnection):
    pass


class _TooLarge(Exception):
    pass


@functools.lru_cache(maxsize=1)
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def _connection(url: str, deadline: float) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
    """A connection for ``url`` (through the environment's proxy, if any), the request target and
    headers the proxy needs."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServiceError(f"{url} is not an http:// or https:// URL")
    timeout = max(0.001, deadline - time.monotonic())
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    kind: Any = _HTTPS if parts.scheme == "https" else _HTTP
    extra: dict[str, Any] = {"context": _tls()} if parts.scheme == "https" else {}
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.hostname):
        return kind(parts.hostname, parts.port, timeout=timeout, deadline=deadline, **extra), target, {}
    via = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    auth = {}
    if via.username:
        secret = f"{urllib.parse.unquote(via.username)}:{urllib.parse.unquote(via.password or '')}"
        auth = {"Proxy-Authorization": "Basic " + base64.b64encode(secret.encode()).decode()}
    if parts.scheme == "http":  # the proxy gets the whole URL
        return _HTTP(via.hostname, via.port, timeout=timeout, deadline=deadline), url, auth
    conn = _HTTPS(via.hostname, via.port, timeout=timeout, deadline=deadline, **extra)
    conn.set_tunnel(parts.hostname, parts.port, headers=auth)
    return conn, target, {}


def _read(response: http.client.HTTPResponse, limit: int, deadline: float) -> bytes:
    declared = response.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _TooLarge
    chunks, size = [], 0
    while chunk := response.read(min(MiB, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise _TooLarge
    if time.monotonic() >= deadline:  # the watcher ended the answer: it is not whole
        raise TimeoutError
    return b"".join(chunks)


def _request(
    url: str, body: bytes | None, headers: Mapping[str, str], deadline: float, limit: int
) -> tuple[int, bytes, str]:
    """(status, body, reason) of one request within ``deadline``."""
    conn, target, more = _connection(url, deadline)
    try:
        failed: OSError | None = None
        try:
            conn.request("GET" if body is None else "POST", target, body=body, headers={**headers, **more})
        except OSError as exc:  # the server may have answered already (413) and closed
            if conn.sock is None:  # no connection at all
                raise
            failed = exc
        try:
            response = conn.getresponse()
        except (OSError, http.client.HTTPException):
            if failed is not None:
                raise failed from None
            raise
        if response.status >= 400:
            return response.status, response.read(2000), response.reason
        return response.status, _read(response, limit, deadline), response.reason
    finally:
        for ident in getattr(conn, "watches", []):
            _DEADLINES.cancel(ident)
        conn.close()


def post(
    url: str,
    body: bytes | None,
    *,
    headers: Mapping[str, str],
    timeout: float,
    retries: int,
    backoff: float,
    what: str,
    limit: int = DEFAULT_LIMIT,
) -> bytes:
    """POST ``body`` (GET when it is None); the answer's body, or :class:`ServiceError` after
    ``retries`` retries. Each request ends within ``timeout`` seconds; an answer larger than
    ``limit`` bytes is refused (not retried)."""
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            delay = backoff * 2 ** (attempt - 1)
            log.warning("%s: %s; retry %d of %d in %.1f s", what, last, attempt, retries, delay)
            time.sleep(delay)
        deadline = time.monotonic() + timeout
        try:
            status, data, reason = _request(url, body, headers, deadline, limit)
        except _TooLarge:
            raise ServiceError(f"{what}: {url} answered more than {limit / MiB:g} MiB (the limit)") from None
        except (OSError, http.client.HTTPException) as exc:
            if time.monotonic() >= deadline or isinstance(exc, (TimeoutError, socket.timeout)):
                last = f"no answer within {timeout:g} s"
            else:
                last = f"cannot reach {url} ({exc or type(exc).__name__})"
            continue
        if status < 400:
            return data
        detail = _error_text(data, reason)
        if status in (401, 403):
            raise ServiceError(f"{what}: {url} refused the token (HTTP {status}: {detail})")
        if status not in RETRY_STATUS:
            raise ServiceError(f"{what}: {url} answered HTTP {status}: {detail}")
        last = f"HTTP {status} ({detail})"
    raise ServiceError(f"{what}: {last}, after {retries} retr{'y' if retries == 1 else 'ies'}")


def _error_text(data: bytes, reason: str) -> str:
    raw = data[:2000].decode("utf-8", "replace")
    try:
        parsed = json.loads(raw)
        if isinstance(parsed, Mapping):
            error = parsed.get("error", parsed)
            if isinstance(error, Mapping):
                error = error.get("message", error)
            return str(error)[:500]
    except ValueError:
        pass
    return raw.strip()[:500] or reason or ""
