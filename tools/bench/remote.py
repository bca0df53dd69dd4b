#!/usr/bin/env python
"""What scoring through ``remote`` costs per image against the same reward in process.

Starts ``fgrpo serve-reward REWARD`` on 127.0.0.1 (a free port), builds the same reward in this
process and a ``remote`` reward pointing at the server, and scores the same batch of images with
both, alternating, ``--repeats`` times. Prints the median seconds per batch of each, the overhead
per image (encoding, HTTP on the loopback, decoding; the server's reward call itself is the same
work as the local one) and the ratio of the two, for each wire format. The default reward is
``jpeg-incompressibility``: cheap, so the overhead is what shows.

    OMP_NUM_THREADS=1 python tools/bench/remote.py --images 32 --size 512 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reward", default="jpeg-incompressibility")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import torch

    from fgrpo.core import registry

    torch.set_num_threads(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FGRPO_REWARD_TOKEN", None)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fgrpo.core.cli",
            "serve-reward",
            args.reward,
            "--port",
            "0",
            "--max-request-mb",
            "2048",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = server.stdout.readline()
        url = line.split(" on ", 1)[1].split()[0]
        local = registry.create("reward", args.reward)
        images = torch.rand(args.images, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
        images = (images * 255).round() / 255  # uint8-exact, so every wire gives the same scores
        prompts, metadata = [f"prompt {i}" for i in range(args.images)], [{} for _ in range(args.images)]
        print(f"{args.reward}, {args.images} images {args.size}x{args.size}, {args.repeats} repeats, server on {url}")
        for wire in ("uint8", "float32"):
            remote = registry.create("reward", "remote", url=url, wire=wire, batch_size=args.images, token_env=None)
            remote(images[:2], prompts[:2], metadata[:2])  # warm both sides
            here, there = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                a = local(images, prompts, metadata)
                t1 = time.perf_counter()
                b = remote(images, prompts, metadata)
                t2 = time.perf_counter()
                here.append(t1 - t0)
                there.append(t2 - t1)
                torch.testing.assert_close(a.scores, b.scores)
            h, t = statistics.median(here), statistics.median(there)
            print(
                f"wire {wire:7s}: in process {1000 * h / args.images:.2f} ms/image, remote "
                f"{1000 * t / args.images:.2f} "
                f"ms/image, overhead {1000 * (t - h) / args.images:.2f} ms/image, remote / in process {t / h:.2f}x"
            )
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
