"""Every HTTP call of fgrpo has a total deadline and a size cap (issue 22): ``timeout`` bounds the
whole request (connect, send, the answer's head and body), not each socket read, and an answer
larger than the cap is refused without holding it in memory. The servers here misbehave on
purpose: they trickle a byte at a time, or answer hundreds of megabytes."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc

import pytest
import torch

from fgrpo.core import registry
from fgrpo.rewards.http import ServiceError, post

MiB = 1 << 20


class RawServer:
    """A listening socket whose every connection is answered by ``respond(conn)`` in a thread."""

    def __init__(self, respond):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.respond, self.stop = respond, threading.Event()
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.listener.settimeout(0.05)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        try:
            conn.settimeout(5)
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            self.respond(conn, request)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.stop.set()
        self.thread.join()
        self.listener.close()


def trickle(stop_after: float = 60.0, where: str = "head"):
    """Answers a byte every 50 ms: in the head, or after a whole head in the body."""

    def respond(conn, _request):
        body = b'{"reward": "x", "params": {}}' + b" " * 4000
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        if where == "body":
            conn.sendall(head)
        data = (head if where == "head" else b"") + body
        t0 = time.monotonic()
        for i in range(len(data)):
            if time.monotonic() - t0 > stop_after:
                return
            conn.sendall(data[i : i + 1])
            time.sleep(0.05)

    return respond


@pytest.mark.parametrize("where", ["head", "body"])
def test_a_trickling_server_cannot_hold_a_call_past_its_timeout(where):
    server = RawServer(trickle(where=where))
    try:
        start = time.monotonic()
        # before: each read got its byte within the timeout, so the call took ~200 s
        with pytest.raises(ServiceError, match=r"no answer within 0.5 s, after 1 retry"):
            post(server.url + "/health", None, headers={}, timeout=0.5, retries=1, backoff=0.01, what="probe")
        elapsed = time.monotonic() - start
    finally:
        server.close()
    assert elapsed < 3.0, f"took {elapsed:.1f} s for two 0.5 s attempts"


def test_remote_and_vlm_judge_calls_are_bounded_by_their_timeout():
    server = RawServer(trickle())
    try:
        start = time.monotonic()
        with pytest.raises(ServiceError, match=r"no answer within 0.4 s"):
            registry.create("reward", "remote", url=server.url, timeout=0.4, retries=0, token_env=None)
        judge = registry.create(
            "reward",
            "vlm-judge",
            model="m",
            url=server.url + "/v1",
            timeout=0.4,
            retries=0,
            api_key_env=None,
            image_size=8,
        )
        with pytest.raises(ServiceError, match=r"no answer within 0.4 s"):
            judge(torch.rand(1, 3, 8, 8), ["a"], [{}])
        elapsed = time.monotonic() - start
    finally:
        server.close()
    assert elapsed < 3.0, f"took {elapsed:.1f} s"


def huge(declare: bool, size: int = 300 * MiB):
    def respond(conn, _request):
        head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {size}\r\n\r\n" if declare else "Connection: close\r\n\r\n"
        conn.sendall(head.encode())
        chunk = b" " * MiB
        for _ in range(size // MiB):
            conn.sendall(chunk)

    return respond


@pytest.mark.parametrize("declare", [True, False], ids=["declared", "until-close"])
def test_an_answer_larger_than_the_cap_is_refused_unheld(declare):
    server = RawServer(huge(declare))
    try:
        tracemalloc.start()
        try:
            # before: all 300 MB read (+1.2 GiB RSS in the judge once decoded)
            with pytest.raises(ServiceError, match=r"answered more than 8 MiB \(the limit\)"):
                post(
                    server.url + "/v1/chat/completions",
                    b"{}",
                    headers={},
                    timeout=30,
                    retries=0,
                    backoff=0,
                    what="vlm-judge m",
                    limit=8 * MiB,
                )
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        server.close()
    assert peak < 24 * MiB, f"held {peak / MiB:.0f} MiB"


def test_the_judges_answer_cap_is_a_recipe_key():
    judge = registry.create("reward", "vlm-judge", model="m")
    assert judge.max_answer_mb == 8.0
    with pytest.raises(Exception, match="reward.max_answer_mb: got 0.0; allowed: > 0"):
        registry.create("reward", "vlm-judge", model="m", max_answer_mb=0)
