#!/usr/bin/env python
"""OCR images/s: the ``ocr`` reward before this change (one rapidocr call per image, rapidocr's
default detector resolution: the shorter side scaled to 736) against now (the detector at most
960 pixels on the longer side, as flow_grpo's PaddleOCR; the recogniser on the lines of all
images at once), and the detector stacked over images (``det_batch``).

The images are rendered text on a white background at the size a policy generates them (512x512
by default), a different text each. Both paths run in the same process on the same images,
alternating ``--repeats`` times, with onnxruntime and torch pinned to ``--threads`` threads; the
script prints the median images/s of each and their ratio, and checks that both read the same.

    OMP_NUM_THREADS=1 python tools/bench/ocr.py --images 8 --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def render(texts: list[str], size: int) -> list[np.ndarray]:
    from PIL import Image, ImageDraw, ImageFont

    out = []
    for i, text in enumerate(texts):
        image = Image.new("RGB", (size, size), (250, 248, 240))
        draw = ImageDraw.Draw(image)
        draw.text(
            (size // 10, size // 3 + (i % 3) * size // 10),
            text,
            fill=(20, 20, 20),
            font=ImageFont.load_default(size=size // 9),
        )
        out.append(np.array(image))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime (and torch) threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-detect", action="store_true", help="recognition only (detect: false)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    from PIL import Image

    from fgrpo.core import registry

    torch.set_num_threads(args.threads)
    words = ["GRPO", "hello", "Flow 2025", "OPEN", "cat", "Sale 50%", "NASA", "Tune in", "coffee", "EXIT"]
    texts = [words[i % len(words)] for i in range(args.images)]
    arrays = render(texts, args.size)
    common = dict(detect=not args.no_detect, threads=args.threads, batch_size=args.images)
    before = registry.create("reward", "ocr", det_side=736, **common)
    before._engine.cfg.Det.limit_type = "min"  # rapidocr's default, which the reward used before
    before._engine.text_det = None
    now = registry.create("reward", "ocr", **common)
    stacked = registry.create("reward", "ocr", det_batch=args.images, **common)
    for r in (before, now, stacked):
        r.read_batch(arrays[:1])  # load the models before timing
    rates: dict[str, list[float]] = {"before": [], "now": [], "stacked": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        old = [before.read(Image.fromarray(a)) for a in arrays]
        t1 = time.perf_counter()
        new = now.read_batch(arrays)
        t2 = time.perf_counter()
        stack = stacked.read_batch(arrays)
        t3 = time.perf_counter()
        for key, dt in (("before", t1 - t0), ("now", t2 - t1), ("stacked", t3 - t2)):
            rates[key].append(args.images / dt)
        assert new == stack, (new, stack)
    a, b, c = (statistics.median(rates[k]) for k in ("before", "now", "stacked"))
    mode = "recognition only" if args.no_detect else "detection + recognition"
    print(
        f"ocr, {mode}, {args.images} images {args.size}x{args.size}, {args.threads} thread(s), {args.repeats} repeats"
    )
    print(f"before (one call per image, detector at 736 min side): {a:.2f} images/s   read {old}")
    print(f"now (detector at <= 960, lines recognised together):   {b:.2f} images/s   read {new}")
    print(f"detector stacked over images (det_batch {args.images}):        {c:.2f} images/s")
    print(f"now / before: {b / a:.2f}x   stacked / now: {c / b:.2f}x")


if __name__ == "__main__":
    main()
