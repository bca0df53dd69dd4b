#!/usr/bin/env python
"""``fgrpo serve-reward`` under hostile and heavy load: threads, memory and time to cut off.

Starts ``fgrpo serve-reward jpeg-compressibility`` on 127.0.0.1 (a free port; ``--server-arg``
adds options) and runs, one after the other:

- ``slowloris``: one client sends a request head one byte a second; how long until the server
  closes the connection (``--observe-s`` at most), and the server's threads meanwhile;
- ``halfopen``: 300 clients each send part of a request head and wait; the server's threads and
  RSS, whether a well-behaved client is still answered (and how fast), and how long until the
  server has closed all 300;
- ``declared``: 8 clients each declare ``Content-Length`` 500 MiB (under the 512 MiB limit), send
  a header declaring float32 outputs and 64 MiB of them, and stall; the server's RSS (now and
  peak) and virtual size, and how long until it has closed all 8.

Figures come from ``/proc/PID/status`` of the server process. ``--throughput`` instead measures
samples per second of one client process against 8 concurrent ones (see :func:`throughput`).

    python tools/bench/reward_server_load.py                       # the three attacks
    python tools/bench/reward_server_load.py --throughput          # 1 client against 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

MiB = 1 << 20


def start(reward: str, extra: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str, int]:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    environment.pop("FGRPO_REWARD_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fgrpo.core.cli", "serve-reward", reward, "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=environment,
    )
    line = proc.stdout.readline()
    if not line.startswith("serving reward"):
        proc.kill()
        raise SystemExit(f"serve-reward did not start: {line!r}")
    url = line.split(" on ", 1)[1].split()[0]
    return proc, url, int(url.rsplit(":", 1)[1].rstrip("/"))


def status(pid: int) -> dict[str, int]:
    """Threads, VmRSS, VmHWM (peak RSS) and VmSize (MiB) of ``pid``."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "Threads":
            found["threads"] = int(value)
        elif key in ("VmRSS", "VmHWM", "VmSize"):
            found[key] = int(value.split()[0]) // 1024
    return found


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (reads reach end of file or an error; an answer it
    sent first, such as a 408 or 503, is read and dropped)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def wait_closed(socks: list[socket.socket], limit: float, tick=None) -> float | None:
    """Seconds until the server closed every socket of ``socks`` (None: not within ``limit``)."""
    t0 = time.monotonic()
    open_ = list(socks)
    while open_ and time.monotonic() - t0 < limit:
        if tick is not None:
            tick(open_)
        open_ = [s for s in open_ if not closed_by_peer(s)]
        if open_:
            time.sleep(0.05)
    return time.monotonic() - t0 if not open_ else None


def health_ms(port: int, timeout: float = 5.0) -> str:
    t0 = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head = s.recv(200)
    except OSError as exc:
        return f"no answer ({type(exc).__name__})"
    code = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else "?"
    return f"HTTP {code} in {1000 * (time.monotonic() - t0):.0f} ms"


def slowloris(pid: int, port: int, observe: float) -> dict:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")
    peak = {"threads": 0}
    sent = [0]

    def tick(open_: list) -> None:
        if int(time.monotonic() - t0) >= sent[0]:  # one byte a second
            try:
                sock.send(b"X-a: b\r\n"[sent[0] % 8 : sent[0] % 8 + 1])
            except OSError:
                pass
            sent[0] += 1
        peak["threads"] = max(peak["threads"], status(pid)["threads"])

    t0 = time.monotonic()
    cut = wait_closed([sock], observe, tick)
    sock.close()
    return {
        "cut off after": f"{cut:.1f} s" if cut is not None else f"not within {observe:.0f} s",
        "server threads": peak["threads"],
    }


def halfopen(pid: int, port: int, observe: float, n: int = 300) -> dict:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n")
        socks.append(s)
    time.sleep(2.0)
    during = status(pid)
    answer = health_ms(port)
    cut = wait_closed(socks, observe)
    for s in socks:
        s.close()
    return {
        "server threads": during["threads"],
        "RSS MiB": during["VmRSS"],
        "a good client meanwhile": answer,
        "all cut off after": f"{cut + 2:.1f} s" if cut is not None else f"not within {observe + 2:.0f} s",
    }


def body_start(size: int, header: int = 256) -> bytes:
    """The first bytes of a ``size``-byte request whose header declares float32 outputs filling it:
    a header the server accepts, so the body is held as it arrives (not refused as malformed)."""
    floats = (size - 8 - header) // 4
    raw = json.dumps(
        {
            "__metadata__": {"prompts": '["x"]', "metadata": "[{}]", "wire": "float32"},
            "outputs": {"dtype": "F32", "shape": [1, floats], "data_offsets": [0, 4 * floats]},
        }
    ).encode()
    return header.to_bytes(8, "little") + raw.ljust(header)


def declared(pid: int, port: int, observe: float, n: int = 8, declare: int = 500 * MiB, send: int = 64 * MiB) -> dict:
    socks, chunk = [], b"\0" * MiB

    def feed(s: socket.socket) -> None:
        try:
            s.sendall(
                b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                + f"Content-Length: {declare}\r\n\r\n".encode()
                + body_start(declare)
            )
            for _ in range(send // MiB):
                s.sendall(chunk)
        except OSError:
            pass  # refused (and closed) early by the server

    for _ in range(n):
        socks.append(socket.create_connection(("127.0.0.1", port)))
    feeders = [threading.Thread(target=feed, args=(s,)) for s in socks]
    t0 = time.monotonic()
    for f in feeders:
        f.start()
    for f in feeders:
        f.join(timeout=observe)
    time.sleep(1.0)
    during = status(pid)
    cut = wait_closed(socks, max(1.0, observe - (time.monotonic() - t0)))
    for s in socks:
        s.close()
    return {
        "RSS MiB": during["VmRSS"],
        "peak RSS MiB": during["VmHWM"],
        "virtual MiB": during["VmSize"],
        "server threads": during["threads"],
        "all cut off after": f"{time.monotonic() - t0:.1f} s" if cut is not None else f"not within {observe:.0f} s",
    }


CLIENT = """
import sys, time, torch
from fgrpo.core import registry
url, batch, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
images = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(0))
prompts, metadata = [f"a photo of thing {i}" for i in range(batch)], [{} for _ in range(batch)]
reward = registry.create("reward", "remote", url=url, batch_size=batch, token_env=None, retries=0)
reward(images, prompts, metadata)  # warm
print("ready", flush=True)
stop = float(sys.stdin.readline())
done = 0
while time.time() < stop:
    reward(images, prompts, metadata)
    done += batch
print(done, flush=True)
"""


def throughput(url: str, clients: int, seconds: float, batch: int, size: int) -> float:
    """Samples per second scored for ``clients`` concurrent client processes (as many training
    processes would be), each a ``remote`` reward sending batches of ``batch`` images of ``size``
    x ``size`` back to back for the same ``seconds`` (started once every client is built and warm)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT, url, str(batch), str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(clients)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    stop = time.time() + seconds
    for p in procs:
        p.stdin.write(f"{stop}\n")
        p.stdin.flush()
    counts = [int(p.communicate()[0].split()[-1]) for p in procs]
    return sum(counts) / seconds


class GPULike:
    """A reward that costs what a model on a GPU costs the host: a fixed 50 ms per call (the
    forward, launches, the copy back) and 0.5 ms per sample, mostly waiting, not computing."""

    batch_size = 64

    def __call__(self, outputs, prompts, metadata):

        from fgrpo.core.protocols import RewardResult

        time.sleep(0.05 + 0.0005 * len(prompts))
        return RewardResult(scores=outputs.flatten(1).mean(1), details={})


@contextlib.contextmanager
def served_reward(kind: str, extra: list[str]):
    """The URL of a server of ``kind``: ``synthetic`` (:class:`GPULike`, served in this process by
    the same server code fgrpo serve-reward runs) or ``clip`` (a tiny random CLIP on the CPU,
    served by ``fgrpo serve-reward clip-score``)."""
    if kind == "clip":
        import tempfile

        from fgrpo.rewards.testing import save_tiny_clip

        folder = save_tiny_clip(Path(tempfile.mkdtemp()) / "clip")
        proc, url, _ = start("clip-score", ["--set", f"path={folder}", "--set", "device=cpu", *extra])
        try:
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        return
    from fgrpo.core import registry

    try:
        from fgrpo.rewards.serving import make_server
    except ImportError:  # fgrpo before issue 22: the threaded server in remote.py
        from fgrpo.rewards.remote import make_server
    registry._loaded[("reward", "gpu-like")] = GPULike
    server = make_server("gpu-like", {}, "127.0.0.1", 0, None, 64 * MiB)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="slowloris,halfopen,declared")
    parser.add_argument("--observe-s", type=float, default=60.0, help="longest wait for a cut-off")
    parser.add_argument("--server-arg", action="append", default=[], help="an option for serve-reward (repeatable)")
    parser.add_argument("--throughput", action="store_true", help="1 client process against 8 instead of the attacks")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    extra = [a for arg in args.server_arg for a in arg.split()]
    if args.throughput:
        for served in ("synthetic", "clip"):
            with served_reward(served, extra) as url:
                one = throughput(url, 1, args.seconds, 8, 32)
                eight = throughput(url, 8, args.seconds, 8, 32)
                one_again = throughput(url, 1, args.seconds, 8, 32)  # the load may have changed meanwhile
            print(
                f"{served}: client processes sending batches of 8 images 32x32: 1 client {one:.0f} then "
                f"{one_again:.0f} "
                f"samples/s, 8 clients {eight:.0f} samples/s, ratio {2 * eight / (one + one_again):.2f}x "
                f"(load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
        return
    proc, url, port = start("jpeg-compressibility", extra)
    try:
        print(f"serve-reward jpeg-compressibility {' '.join(extra)} on {url}: at rest {status(proc.pid)}")
        for case in args.cases.split(","):
            figures = {"slowloris": slowloris, "halfopen": halfopen, "declared": declared}[case](
                proc.pid, port, args.observe_s
            )
            print(f"{case}: " + "; ".join(f"{k} {v}" for k, v in figures.items()), flush=True)
            time.sleep(1.0)
        print(f"after: {status(proc.pid)}; a good client {health_ms(port)}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
