"""Pictures a run leaves behind: a grid of evaluation samples with their prompts, and curves."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) floats in [0, 1] -> (B, H, W, 3) uint8."""
    arr = images.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8)
    return arr.permute(0, 2, 3, 1).cpu().numpy()


def is_image_batch(outputs: Any) -> bool:
    return isinstance(outputs, torch.Tensor) and outputs.dim() == 4 and outputs.shape[1] == 3


def sample_grid(images: torch.Tensor, captions: Sequence[str], path: Path, *, cell: int = 128, columns: int = 8) -> Path:
    """Each image scaled to ``cell`` px (nearest: small images stay crisp) with its prompt under it."""
    pics = to_uint8(images)
    n = len(pics)
    columns = min(columns, n)
    rows = math.ceil(n / columns)
    text_h = 40
    grid = Image.new("RGB", (columns * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for i, (pic, caption) in enumerate(zip(pics, captions)):
        x, y = (i % columns) * cell, (i // columns) * (cell + text_h)
        grid.paste(Image.fromarray(pic).resize((cell, cell), Image.NEAREST), (x, y))
        lines = textwrap.wrap(caption, width=max(8, cell // 6))[:3]
        draw.multiline_text((x + 2, y + cell + 1), "\n".join(lines), fill="black", font=font, spacing=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def curve_keys(rows: Sequence[dict]) -> list[str]:
    keys: list[str] = []
    for row in rows:
        for key, value in row.items():
            if key in keys or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            last = key.split("/")[-1]  # eval/<reward>/<detail>; per-category keys have one more part
            if key in ("reward_mean", "eval/reward_mean") or (
                key.count("/") == 2 and key.startswith("eval/") and (last.endswith("accuracy") or "gold" in last)
            ):
                keys.append(key)
    return keys


def curves(rows: Sequence[dict], path: Path) -> Path | None:
    """Train reward, evaluation accuracy and gold metrics against iteration (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = curve_keys(rows)
    if not keys:
        return None
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(r["iteration"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("iteration")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
