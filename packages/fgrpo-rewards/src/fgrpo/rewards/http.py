"""A small HTTP client for rewards served elsewhere (``vlm-judge``, ``remote``): the standard
library only, timeouts on every request, retries with exponential backoff on what a retry can fix
(no connection, a timeout, HTTP 429/502/503/504), one clear error for the rest."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Mapping

from fgrpo.core.registry import ComponentError

log = logging.getLogger(__name__)

RETRY_STATUS = (429, 502, 503, 504)


class ServiceError(ComponentError):
    """A reward service failed (unreachable, refused, or answered something unusable)."""


def token_from_env(name: str | None) -> str | None:
    """Secrets come from the environment, never from a recipe (recipes are logged and copied)."""
    return os.environ.get(name) or None if name else None


def post(
    url: str,
    body: bytes | None,
    *,
    headers: Mapping[str, str],
    timeout: float,
    retries: int,
    backoff: float,
    what: str,
) -> bytes:
    """POST ``body`` (GET when it is None); the response body, or :class:`ServiceError` after
    ``retries`` retries."""
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            delay = backoff * 2 ** (attempt - 1)
            log.warning("%s: %s; retry %d of %d in %.1f s", what, last, attempt, retries, delay)
            time.sleep(delay)
        request = urllib.request.Request(url, data=body, headers=dict(headers), method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            detail = _error_text(exc)
            if exc.code in (401, 403):
                raise ServiceError(f"{what}: {url} refused the token (HTTP {exc.code}: {detail})") from None
            if exc.code not in RETRY_STATUS:
                raise ServiceError(f"{what}: {url} answered HTTP {exc.code}: {detail}") from None
            last = f"HTTP {exc.code} ({detail})"
        except (TimeoutError, socket.timeout):
            last = f"no answer within {timeout:g} s"
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                last = f"no answer within {timeout:g} s"
            else:
                last = f"cannot reach {url} ({reason})"
    raise ServiceError(f"{what}: {last}, after {retries} retr{'y' if retries == 1 else 'ies'}")


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        raw = exc.read()[:2000].decode("utf-8", "replace")
    except Exception:  # the body is already gone
        return exc.reason or ""
    try:
        data = json.loads(raw)
        if isinstance(data, Mapping):
            error = data.get("error", data)
            if isinstance(error, Mapping):
                error = error.get("message", error)
            return str(error)[:500]
    except ValueError:
        pass
    return raw.strip()[:500] or str(exc.reason)
