"""Pictures a run leaves behind: a grid of evaluation samples with their prompts, and curves."""

from __future__ import annotations

import io
import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from fgrpo.core import confine


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) floats in [0, 1] -> (B, H, W, 3) uint8 (clamped, rounded), on the CPU: what
    PIL, image files and image rewards take."""
    if not is_image_batch(images):
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"expected images of shape (B, 3, H, W) in [0, 1], got {shape}")
    arr = images.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8)
    return arr.permute(0, 2, 3, 1).cpu().numpy()


def is_image_batch(outputs: Any) -> bool:
    return isinstance(outputs, torch.Tensor) and outputs.dim() == 4 and outputs.shape[1] == 3


SEPARATOR = (200, 200, 200)
LINE_HEIGHT = 12


def _wrap(text: str, width: int, lines: int) -> list[str]:
    wrapped = textwrap.wrap(text, width=width)
    if len(wrapped) > lines:
        wrapped = wrapped[:lines]
        wrapped[-1] = wrapped[-1][: max(0, width - 1)] + "…"
    return wrapped


def grid_image(
    images: torch.Tensor,
    captions: Sequence[str],
    notes: Sequence[str] | None = None,
    *,
    cell: int = 128,
    columns: int = 8,
    gap: int = 2,
) -> Image.Image:
    """Each image scaled to ``cell`` px high (nearest: small images stay crisp; a wide image, such
    as an edit's source -> output, keeps its aspect ratio), a thin grey line between tiles, its
    prompt under it and, in grey, its ``note`` (the score, what was read)."""
    pics = to_uint8(images)
    n = len(pics)
    columns = min(columns, n)
    rows = math.ceil(n / columns)
    cell_w = max(1, round(cell * pics.shape[2] / pics.shape[1]))
    width = max(8, cell_w // 6)
    texts = [_wrap(c, width, 3) for c in captions]
    extra = [_wrap(note, width, 3) for note in notes] if notes is not None else [[] for _ in range(n)]
    text_h = LINE_HEIGHT * max(len(a) + len(b) for a, b in zip(texts, extra, strict=True)) + 4
    tile_w, tile_h = cell_w + gap, cell + text_h + gap
    grid = Image.new("RGB", (columns * tile_w - gap, rows * tile_h - gap), SEPARATOR)
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for i in range(n, rows * columns):  # the empty end of the last row
        x, y = (i % columns) * tile_w, (i // columns) * tile_h
        draw.rectangle((x - gap, y - gap, x + tile_w, y + tile_h), fill="white")
    for i, pic in enumerate(pics):
        x, y = (i % columns) * tile_w, (i // columns) * tile_h
        draw.rectangle((x, y + cell, x + cell_w - 1, y + cell + text_h - 1), fill="white")
        grid.paste(Image.fromarray(pic).resize((cell_w, cell), Image.Resampling.NEAREST), (x, y))
        for k, line in enumerate(texts[i]):
            draw.text((x + 2, y + cell + 1 + k * LINE_HEIGHT), line, fill="black", font=font)
        for k, line in enumerate(extra[i], start=len(texts[i])):
            draw.text((x + 2, y + cell + 1 + k * LINE_HEIGHT), line, fill=(90, 90, 90), font=font)
    return grid


def sample_grid(
    images: torch.Tensor, captions: Sequence[str], path: Path, *, notes: Sequence[str] | None = None, **layout: Any
) -> Image.Image:
    """:func:`grid_image` saved as a PNG at ``path``; returns the image."""
    grid = grid_image(images, captions, notes, **layout)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return grid


THUMBNAIL = 256  #: the largest side of a stored tile; larger images are scaled down and kept as JPEG
SMALL = (
    96  #: a tile whose height is under this is stored magnified (nearest, an integer factor): shown at its own size
)
MARK = (255, 0, 255)  #: the outline of a marked region (an edit's target cells)


def magnified(images: torch.Tensor, least: int = SMALL) -> torch.Tensor:
    """(B, 3, H, W) magnified by the integer factor that brings H to ``least`` or more (nearest:
    every pixel a crisp block), unchanged when H is that already."""
    factor = max(1, -(-least // images.shape[-2]))
    return images if factor == 1 else images.repeat_interleave(factor, -2).repeat_interleave(factor, -1)


def outline(
    images: torch.Tensor, boxes: Sequence[Sequence[tuple[float, float, float, float]]], panels: Sequence[int]
) -> torch.Tensor:
    """The images magnified (:func:`magnified`) with each box outlined in every panel of its image:
    an image of ``panels[i]`` panels side by side (an edit's sources, then its output, a one-pixel
    gap between them) has each box, in fractions of one panel, drawn on each of them."""
    height = images.shape[-2]
    big = magnified(images)
    factor = big.shape[-2] // height
    out = []
    for image, marks, count in zip(to_uint8(big), boxes, panels, strict=True):
        picture = Image.fromarray(image)
        draw = ImageDraw.Draw(picture)
        panel = (images.shape[-1] - (count - 1)) / count  # a panel's width before magnifying
        for k in range(count):
            left = k * (panel + 1) * factor
            for x0, y0, x1, y1 in marks:
                draw.rectangle(
                    (
                        round(left + x0 * panel * factor),
                        round(y0 * height * factor),
                        round(left + x1 * panel * factor) - 1,
                        round(y1 * height * factor) - 1,
                    ),
                    outline=MARK,
                    width=max(1, factor // 2),
                )
        out.append(torch.from_numpy(np.asarray(picture, dtype=np.float32) / 255.0).permute(2, 0, 1))
    return torch.stack(out)


def write_tiles(images: torch.Tensor, rows: Sequence[dict[str, Any]], folder: Path) -> Path:
    """One file per image (PNG at its own size up to THUMBNAIL px, else a THUMBNAIL-px JPEG; one
    under SMALL px high magnified) and ``index.json`` listing each tile's file, its ``width`` and
    ``height`` (what the report shows it at) and ``rows[i]`` (prompt, score, what was read ...):
    what the run report's filmstrip shows, evaluation by evaluation."""
    folder.mkdir(parents=True, exist_ok=True)
    index = []
    for i, (pic, row) in enumerate(zip(to_uint8(magnified(images)), rows, strict=True)):
        image = Image.fromarray(pic)
        if max(image.size) > THUMBNAIL:
            image.thumbnail((THUMBNAIL, THUMBNAIL), Image.Resampling.LANCZOS)
            name = f"{i:03d}.jpg"
            image.save(folder / name, quality=85)
        else:
            name = f"{i:03d}.png"
            image.save(folder / name)
        index.append({"file": name, "width": image.size[0], "height": image.size[1], **row})
    (folder / "index.json").write_text(json.dumps(index, indent=1))
    return folder


def curve_keys(rows: Sequence[dict]) -> list[str]:
    """The panels of ``curves.png``: the training reward, the held-out reward (the proxy RL
    optimises), the held-out accuracy and a reward's own gold detail, then every gold metric of
    every evaluator (``gold/<label>/<metric>``; per-category keys have one more part)."""
    keys: list[str] = []
    for row in rows:
        for key, value in row.items():
            if key in keys or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            head, last, parts = key.split("/")[0], key.split("/")[-1], key.count("/") + 1
            scored = "accuracy" in last or "gold" in last or last == "strict"
            held_out_score = head == "eval" and parts == 3 and scored
            if key in ("reward_mean", "eval/reward_mean") or held_out_score or (head == "gold" and parts == 3):
                keys.append(key)
    return sorted(keys, key=lambda k: (not k.startswith("reward_mean"), k.startswith("gold/")))


def have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def curves(rows: Sequence[dict], path: Path, directions: Mapping[str, str] | None = None) -> Path | None:
    """Train reward, the held-out reward and accuracy and every gold metric against iteration, each
    with the base's value (needs matplotlib); ``directions``: gold metric -> "higher" / "lower"."""
    directions = directions or {}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = curve_keys(rows)
    if not keys:
        return None
    columns = 1 if len(keys) <= 4 else 2
    height = -(-len(keys) // columns)
    fig, axes = plt.subplots(height, columns, figsize=(7 * columns, 2.2 * height), sharex=True, squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        pts = [(r["iteration"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        base = next((v for it, v in pts if it == 0), None)
        if base is not None and key != "reward_mean":  # the base's value, from the evaluation at iteration 0
            ax.axhline(base, color="0.4", linestyle="--", linewidth=1, label=f"base {base:.4g}")
            ax.legend(fontsize=7, loc="best")
        better = directions.get(key.split("/")[-1]) if key.startswith("gold/") else None
        ax.set_title(key + (f" ({better} is better)" if better else ""), fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("iteration")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    plt.close(fig)
    confine.write_atomic(path, png.getvalue())  # whole or not at all: a full disk leaves the old one
    return path
