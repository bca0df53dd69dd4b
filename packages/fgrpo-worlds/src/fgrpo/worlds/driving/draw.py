"""Top-down pictures of driving scenes for sample grids and the run report.

The road runs left to right (x: 20 m behind the ego to 100 m ahead; lateral distances drawn 1.5x
larger so lanes stay readable): grey lanes with white lines, other cars blue, the ego green.
Candidate plans are polylines coloured from red (the group's lowest score) to green (its highest),
the sample's own plan thick; a closed-loop picture adds the executed path (black) with a red cross
where the ego collided.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

import fgrpo.worlds.driving.sim as sim
from fgrpo.worlds.driving.world import CAR_LENGTH, Scene

WIDTH, HEIGHT = 192, 72
LOOP_WIDTH = 256  #: a closed loop's picture (the whole 12 s drive, to scale along the road)
BEHIND, AHEAD = 20.0, 100.0
LATERAL = 1.5  #: lateral exaggeration
ROAD, LINE, EDGE, CAR, EGO, PATH = (
    (110, 110, 110),
    (235, 235, 235),
    (250, 250, 250),
    (60, 110, 220),
    (40, 190, 70),
    (20, 20, 20),
)


class _View:
    def __init__(self, scene: Scene, b: int):
        self.x0 = float(scene.ego[b, 0]) - BEHIND
        self.sx = WIDTH / (AHEAD + BEHIND)
        self.sy = self.sx * LATERAL
        self.road = float(scene.lanes[b] * scene.lane_width[b])
        self.top = (HEIGHT + self.road * self.sy) / 2

    def px(self, x: float, y: float) -> tuple[float, float]:
        return (x - self.x0) * self.sx, self.top - y * self.sy


def _road(draw: ImageDraw.ImageDraw, view: _View, scene: Scene, b: int, pixels: int = WIDTH) -> None:
    lanes, width = int(scene.lanes[b]), float(scene.lane_width[b])
    draw.rectangle((0, view.px(0, view.road)[1], pixels, view.px(0, 0)[1]), fill=ROAD)
    for i in range(lanes + 1):
        y = view.px(0, i * width)[1]
        if i in (0, lanes):
            draw.line((0, y, pixels, y), fill=EDGE, width=1)
        else:
            for start in range(0, pixels, 8):
                draw.line((start, y, start + 4, y), fill=LINE, width=1)


def _car(draw: ImageDraw.ImageDraw, view: _View, x: float, y: float, psi: float, colour: tuple[int, int, int]) -> None:
    corners = sim.box_corners(torch.tensor(x), torch.tensor(y), torch.tensor(psi)).tolist()
    draw.polygon([view.px(cx, cy) for cx, cy in corners], fill=colour)


def _cars(draw: ImageDraw.ImageDraw, view: _View, scene: Scene, b: int) -> None:
    for (x, y, psi, _), valid in zip(scene.agents[b].tolist(), scene.valid[b].tolist(), strict=True):
        if valid and -BEHIND - CAR_LENGTH < x - view.x0 - BEHIND < AHEAD + CAR_LENGTH:
            _car(draw, view, x, y, psi, CAR)
    _car(draw, view, float(scene.ego[b, 0]), float(scene.ego[b, 1]), float(scene.ego[b, 2]), EGO)


def _colour(score: float, low: float, high: float) -> tuple[int, int, int]:
    s = 0.5 if high <= low else (score - low) / (high - low)
    return int(230 * (1 - s)), int(60 + 170 * s), 40


def _to_tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


def draw_scene(
    scene: Scene, b: int, plans: Sequence[torch.Tensor] = (), scores: Sequence[float] = (), own: int | None = None
) -> torch.Tensor:
    """(3, HEIGHT, WIDTH) in [0, 1]: scene ``b`` with candidate plans (ego frame) coloured by score."""
    image = Image.new("RGB", (WIDTH, HEIGHT), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    view = _View(scene, b)
    _road(draw, view, scene, b)
    _cars(draw, view, scene, b)
    low, high = (min(scores), max(scores)) if len(scores) else (0.0, 1.0)
    order = sorted(range(len(plans)), key=lambda i: (i == own, scores[i] if len(scores) else 0))
    ego = scene.ego[b : b + 1]
    for i in order:
        points = sim.plan_path(plans[i][None], ego)[0].tolist()
        colour = _colour(float(scores[i]), low, high) if len(scores) else PATH
        draw.line([view.px(x, y) for x, y in points], fill=colour, width=3 if i == own else 1)
    return _to_tensor(image)


def draw_groups(scenes: Scene, plans: torch.Tensor, scores: torch.Tensor, per_prompt: int) -> torch.Tensor:
    """(B, 3, H, W): sample b drawn on its scene with the plans of its whole group (the samples of
    its prompt, prompt-major), coloured by score, its own thick."""
    out = []
    for b in range(len(scenes)):
        first = b - b % per_prompt
        group = range(first, min(first + per_prompt, len(scenes)))
        out.append(draw_scene(scenes, b, [plans[i] for i in group], [float(scores[i]) for i in group], own=b - first))
    return torch.stack(out)


def draw_closed_loop(start: Scene, end: Scene, b: int, path: torch.Tensor, collided_at: int | None) -> torch.Tensor:
    """(3, H, LOOP_WIDTH): the closed loop of scene ``b``: the road and the cars as they were at ``end``
    (the ego's start faded), the executed path ``path`` (S, 2, world frame) in black and a red
    cross at step ``collided_at`` where it collided."""
    image = Image.new("RGB", (LOOP_WIDTH, HEIGHT), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    view = _View(start, b)
    view.sx = LOOP_WIDTH / (float(path[:, 0].max() - path[0, 0]) + BEHIND + 40.0)
    view.sy = max(view.sx * LATERAL, 3.0)
    view.top = (HEIGHT + view.road * view.sy) / 2
    _road(draw, view, start, b, LOOP_WIDTH)
    _car(draw, view, float(start.ego[b, 0]), float(start.ego[b, 1]), float(start.ego[b, 2]), (170, 225, 180))
    for (x, y, psi, _), valid in zip(end.agents[b].tolist(), end.valid[b].tolist(), strict=True):
        if valid:
            _car(draw, view, x, y, psi, CAR)
    _car(draw, view, float(end.ego[b, 0]), float(end.ego[b, 1]), float(end.ego[b, 2]), EGO)
    draw.line([view.px(x, y) for x, y in path.tolist()], fill=PATH, width=1)
    if collided_at is not None:
        cx, cy = view.px(*path[collided_at].tolist())
        draw.line((cx - 4, cy - 4, cx + 4, cy + 4), fill=(220, 20, 20), width=2)
        draw.line((cx - 4, cy + 4, cx + 4, cy - 4), fill=(220, 20, 20), width=2)
    return _to_tensor(image)
