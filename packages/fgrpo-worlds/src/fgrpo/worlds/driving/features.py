"""The scene encoding a planner conditions on: 38 numbers per scene, all in the ego's frame.

- the ego (8): speed / 30, acceleration / 4, offset from its lane's centre / (W / 2), heading x 10,
  whether a lane exists on the left and on the right, the speed limit / 30, (speed - limit) / 10;
- six slots (5 each): the nearest car ahead and behind in the ego's lane, the lane on its left and
  the lane on its right. A car belongs to the lane whose centre is nearest to it, and a car that is
  changing lanes also counts in the lane it is moving into. A slot holds: present, bumper gap / 50
  (signed: behind is negative), (its speed - the ego's) / 10, its offset from that lane's centre
  / (W / 2), its lateral speed / 2. An empty slot is (0, +-2, 0, 0, 0).
"""

from __future__ import annotations

import math

import torch

from fgrpo.worlds.driving.sim import scripted_y
from fgrpo.worlds.driving.world import CAR_LENGTH, Scene, lane_centre, nearest_lane

EGO_FEATURES = 8
SLOT_FEATURES = 5
SLOTS = (("same", 1), ("same", -1), ("left", 1), ("left", -1), ("right", 1), ("right", -1))
SIZE = EGO_FEATURES + SLOT_FEATURES * len(SLOTS)  # 38


def encode(scene: Scene) -> torch.Tensor:
    """(B, SIZE) float32 features of a batch of scenes."""
    x, y, psi, v, a = scene.ego.unbind(-1)
    lanes, width, limit = scene.lanes, scene.lane_width, scene.speed_limit
    lane = nearest_lane(y, lanes, width)
    half = width / 2
    ego = torch.stack(
        [
            v / 30.0,
            a / 4.0,
            (y - lane_centre(lane, width)) / half,
            psi * 10.0,
            (lane + 1 < lanes).float(),
            (lane > 0).float(),
            limit / 30.0,
            (v - limit) / 10.0,
        ],
        1,
    )
    ax, ay, _, av = scene.agents.unbind(-1)
    soon = scripted_y(scene, scene.t + 0.5)
    lateral_v = (soon - ay) / 0.5
    agent_lane = nearest_lane(ay, lanes[:, None], width[:, None])
    heading_to = nearest_lane(soon + (soon - ay) * 2, lanes[:, None], width[:, None])
    slots = []
    for which, direction in SLOTS:
        target = lane + {"same": 0.0, "left": 1.0, "right": -1.0}[which]
        exists = (target >= 0) & (target < lanes)
        member = scene.valid & ((agent_lane == target[:, None]) | (heading_to == target[:, None])) & exists[:, None]
        dx = (ax - x[:, None]) * direction
        member = member & (dx > 0)
        dist = torch.where(member, dx, torch.full_like(dx, math.inf))
        nearest, j = dist.min(1)
        found = torch.isfinite(nearest)

        def pick(t: torch.Tensor, j: torch.Tensor = j) -> torch.Tensor:
            return torch.gather(t, 1, j[:, None])[:, 0]

        gap = ((nearest - CAR_LENGTH) / 50.0).clamp(max=2.0) * direction
        slot = torch.stack(
            [
                found.float(),
                torch.where(found, gap, torch.full_like(gap, 2.0 * direction)),
                torch.where(found, (pick(av) - v) / 10.0, torch.zeros_like(v)),
                torch.where(found, (pick(ay) - lane_centre(target, width)) / half, torch.zeros_like(v)),
                torch.where(found, pick(lateral_v) / 2.0, torch.zeros_like(v)),
            ],
            1,
        )
        slots.append(slot)
    return torch.cat([ego, *slots], 1).float()
