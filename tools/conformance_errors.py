#!/usr/bin/env python
"""The largest error of every backbone's pipeline comparisons, as a table.

    FGRPO_CONFORMANCE_ERRORS=/tmp/errors.jsonl pytest -q packages/fgrpo-models/tests
    python tools/conformance_errors.py /tmp/errors.jsonl

Each conformance check that compares fgrpo against the diffusers pipeline (our Euler loop
against ``pipe(output_type="latent")`` with and without guidance, ``decode`` against the
pipeline's decoding, the exported LoRA loaded by the plain pipeline) appends its largest
absolute error to the file named by ``FGRPO_CONFORMANCE_ERRORS``; this prints the largest per
(backbone, check) with the tolerance the test holds it to.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def table(rows: list[dict]) -> list[str]:
    worst: dict[tuple[str, str], dict] = {}
    for row in rows:
        key = (row["model"], row["check"])
        if key not in worst or row["max_abs_error"] > worst[key]["max_abs_error"]:
            worst[key] = row
    lines = ["| backbone | check | max abs error | tolerance |", "|---|---|---|---|"]
    for (model, check), row in sorted(worst.items()):
        lines.append(f"| {model} | {check} | {row['max_abs_error']:.2e} | {row['atol']:g} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("errors", type=Path, help="the FGRPO_CONFORMANCE_ERRORS file the tests wrote")
    args = parser.parse_args(argv)
    try:
        rows = [json.loads(line) for line in args.errors.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        print(f"{args.errors}: {exc}", file=sys.stderr)
        return 2
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
