"""Top-down pictures of driving scenes for sample grids and the run report.

The road runs left to right (x: 20 m behind the ego to 100 m ahead; lateral distances drawn 1.5x
larger so lanes stay readable): grey lanes with white lines, other cars blue, the ego green.
A sample's picture shows its group's candidate plans coloured from red (the group's lowest score)
to green (its highest), the sample's own thick, each ending in a dot; under the road, each plan's
distance against time, where plans that share a lane but not a speed come apart. A closed loop is
drawn as frames down the picture (every 3 s of the drive by default), each centred on the ego
among the traffic of that moment, the executed path black up to it and grey after it, a red cross
where the ego collided.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

import fgrpo.worlds.driving.sim as sim
from fgrpo.worlds.driving.world import CAR_LENGTH, Scene

SCALE = 2  #: pixels per pixel of the first pictures (192 x 72): a report shows these at their native width
WIDTH, HEIGHT = 192 * SCALE, 48 * SCALE  #: a four-lane road (71 px at this scale) with room for plans beside it
PROFILE = 36 * SCALE  #: the distance-against-time panel under a sample's road
FRAME = 46 * SCALE  #: one closed-loop frame: a line of text over the road
LABEL = 12  #: pixels of a frame's text line
BEHIND, AHEAD = 20.0, 100.0
LATERAL = 1.5  #: lateral exaggeration
PLAN_STEP = 0.5  #: seconds between a plan's waypoints
BACKGROUND, ROAD, LINE, EDGE, CAR, EGO, PATH, LATER, TEXT, CRASH = (
    (245, 245, 245),
    (110, 110, 110),
    (235, 235, 235),
    (250, 250, 250),
    (60, 110, 220),
    (40, 190, 70),
    (20, 20, 20),
    (175, 175, 175),
    (40, 40, 40),
    (220, 20, 20),
)
FONT = ImageFont.load_default()


class _View:
    """World metres -> pixels: ``x0`` at the left edge, the road centred in a panel ``height`` high
    whose top is at ``y_offset``."""

    def __init__(self, scene: Scene, b: int, centre_x: float, height: int, y_offset: int = 0):
        self.x0 = centre_x - BEHIND
        self.sx = WIDTH / (AHEAD + BEHIND)
        self.sy = self.sx * LATERAL
        self.road = float(scene.lanes[b] * scene.lane_width[b])
        self.top = y_offset + (height + self.road * self.sy) / 2

    def px(self, x: float, y: float) -> tuple[float, float]:
        return (x - self.x0) * self.sx, self.top - y * self.sy


def _road(draw: ImageDraw.ImageDraw, view: _View, scene: Scene, b: int) -> None:
    lanes, width = int(scene.lanes[b]), float(scene.lane_width[b])
    draw.rectangle((0, view.px(0, view.road)[1], WIDTH, view.px(0, 0)[1]), fill=ROAD)
    for i in range(lanes + 1):
        y = view.px(0, i * width)[1]
        if i in (0, lanes):
            draw.line((0, y, WIDTH, y), fill=EDGE, width=SCALE)
        else:
            for start in range(0, WIDTH, 8 * SCALE):
                draw.line((start, y, start + 4 * SCALE, y), fill=LINE, width=1)


def _car(draw: ImageDraw.ImageDraw, view: _View, x: float, y: float, psi: float, colour: tuple[int, int, int]) -> None:
    corners = sim.box_corners(torch.tensor(x), torch.tensor(y), torch.tensor(psi)).tolist()
    draw.polygon([view.px(cx, cy) for cx, cy in corners], fill=colour, outline=PATH)


def _cars(draw: ImageDraw.ImageDraw, view: _View, scene: Scene, b: int) -> None:
    for (x, y, psi, _), valid in zip(scene.agents[b].tolist(), scene.valid[b].tolist(), strict=True):
        if valid and -CAR_LENGTH < x - view.x0 < AHEAD + BEHIND + CAR_LENGTH:
            _car(draw, view, x, y, psi, CAR)
    _car(draw, view, float(scene.ego[b, 0]), float(scene.ego[b, 1]), float(scene.ego[b, 2]), EGO)


def _colour(score: float, low: float, high: float) -> tuple[int, int, int]:
    s = 0.5 if high <= low else (score - low) / (high - low)
    return int(230 * (1 - s)), int(60 + 170 * s), 40


def _to_tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


def _dot(draw: ImageDraw.ImageDraw, at: tuple[float, float], colour: tuple[int, int, int], r: float) -> None:
    draw.ellipse((at[0] - r, at[1] - r, at[0] + r, at[1] + r), fill=colour, outline=PATH)


def _profile(
    draw: ImageDraw.ImageDraw, plans: Sequence[torch.Tensor], colours: Sequence[tuple[int, int, int]], own: int | None
) -> None:
    """Under the road: each plan's distance ahead (m, ego frame) against time (s), one line each."""
    top, left, bottom, right = HEIGHT + 12, 4, HEIGHT + PROFILE - 3, WIDTH - 4
    draw.line((left, bottom, right, bottom), fill=LATER)
    distances = [[0.0] + [float(p) for p in plan[:, 0]] for plan in plans]
    reach = max((max(d) for d in distances), default=1.0) or 1.0
    horizon = max((len(d) - 1 for d in distances), default=1) * PLAN_STEP
    draw.text(
        (left, HEIGHT + 1), f"distance ahead vs time: {reach:.0f} m in {horizon:g} s at most", fill=TEXT, font=FONT
    )
    for i in sorted(range(len(plans)), key=lambda i: i == own):
        points = [
            (left + k * PLAN_STEP / horizon * (right - left), bottom - max(d, 0.0) / reach * (bottom - top))
            for k, d in enumerate(distances[i])
        ]
        draw.line(points, fill=colours[i], width=3 if i == own else 1)


def draw_scene(
    scene: Scene, b: int, plans: Sequence[torch.Tensor] = (), scores: Sequence[float] = (), own: int | None = None
) -> torch.Tensor:
    """(3, HEIGHT + PROFILE, WIDTH) in [0, 1]: scene ``b`` with candidate plans (ego frame)
    coloured by score, each ending in a dot, and their distances against time under the road."""
    image = Image.new("RGB", (WIDTH, HEIGHT + PROFILE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    view = _View(scene, b, float(scene.ego[b, 0]), HEIGHT)
    _road(draw, view, scene, b)
    _cars(draw, view, scene, b)
    low, high = (min(scores), max(scores)) if len(scores) else (0.0, 1.0)
    colours = [_colour(float(scores[i]), low, high) if len(scores) else PATH for i in range(len(plans))]
    ego = scene.ego[b : b + 1]
    for i in sorted(range(len(plans)), key=lambda i: (i == own, scores[i] if len(scores) else 0)):
        points = [view.px(x, y) for x, y in sim.plan_path(plans[i][None, :, :2], ego)[0].tolist()]
        draw.line(points, fill=colours[i], width=3 * SCALE // 2 + 1 if i == own else SCALE // 2 + 1)
        _dot(draw, points[-1], colours[i], 2.5 * SCALE if i == own else 1.5 * SCALE)
    _profile(draw, plans, colours, own)
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


def frame_times(seconds: float, replan: float, frames: int = 5) -> list[float]:
    """The moments a closed loop's picture shows: the start, the end and evenly between, each a
    multiple of the replanning period (the times the loop can keep the scene of)."""
    steps = round(seconds / replan)
    return sorted({round(round(k * steps / (frames - 1)) * replan, 6) for k in range(frames)})


def draw_closed_loop(
    frames: Mapping[float, Scene], b: int, path: torch.Tensor, collided_at: int | None, dt: float = sim.DT
) -> torch.Tensor:
    """(3, len(frames) x FRAME, WIDTH): the closed loop of scene ``b`` as frames at the times of
    ``frames`` (time -> the scene then): each the ego among that moment's traffic, the executed
    ``path`` (S, 2, world frame, one point per ``dt``) black up to that moment and grey after it,
    a red cross at step ``collided_at`` where it collided."""
    times = sorted(frames)
    image = Image.new("RGB", (WIDTH, FRAME * len(times)), BACKGROUND)
    draw = ImageDraw.Draw(image)
    points = path.tolist()
    for row, t in enumerate(times):
        scene = frames[t]
        view = _View(scene, b, float(scene.ego[b, 0]), FRAME - LABEL, row * FRAME + LABEL)
        _road(draw, view, scene, b)
        now = min(round(t / dt), len(points) - 1)
        draw.line([view.px(x, y) for x, y in points[now:]], fill=LATER, width=SCALE)
        draw.line([view.px(x, y) for x, y in points[: now + 1]], fill=PATH, width=SCALE)
        _cars(draw, view, scene, b)
        if collided_at is not None and collided_at <= now:
            cx, cy = view.px(*points[collided_at])
            r = 4 * SCALE
            draw.line((cx - r, cy - r, cx + r, cy + r), fill=CRASH, width=SCALE + 1)
            draw.line((cx - r, cy + r, cx + r, cy - r), fill=CRASH, width=SCALE + 1)
        speed, limit = float(scene.ego[b, 3]), float(scene.speed_limit[b])
        draw.text((3, row * FRAME + 1), f"t = {t:g} s   {speed:.1f} m/s (limit {limit:.0f})", fill=TEXT, font=FONT)
        if row:
            draw.line((0, row * FRAME, WIDTH, row * FRAME), fill=PATH, width=1)
    return _to_tensor(image)
