#!/usr/bin/env python
"""Write a tiny random diffusers pipeline to a folder, for benchmarks and side-by-side runs.

    python tools/make_tiny_pipeline.py sd3 tiny-sd3
    python tools/make_tiny_pipeline.py flux tiny-flux

The folder loads with ``<Pipeline>.from_pretrained(DIR)`` offline, in fgrpo (``model.path: DIR``)
and in any other implementation that loads diffusers pipelines (flow_grpo's
``config.pretrained.model``), so both run the very same random weights. ``--seed`` fixes the
weights. The image side of the saved pipeline is its transformer's default; recipes pick the
resolution (``model.resolution``), e.g. 64 or 128 px for the SD3 one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def builders() -> dict:
    """Every tiny-pipeline builder of fgrpo-models' testing modules, by kind (``sd3``, ``wan22-i2v``, ...)."""
    try:
        from fgrpo.models.testing import pipelines
    except ImportError:
        raise SystemExit("the tiny-pipeline builders are not installed: pip install fgrpo-models") from None
    return {kind.replace("_", "-"): build for kind, build in pipelines.builders().items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    found = builders()
    parser.add_argument("kind", choices=sorted(found))
    parser.add_argument("out", type=Path, help="folder to write (created; must be empty or absent)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"error: {args.out} exists and is not empty", file=sys.stderr)
        return 2
    found[args.kind](args.out, seed=args.seed)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote a tiny random {args.kind} pipeline to {args.out} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
