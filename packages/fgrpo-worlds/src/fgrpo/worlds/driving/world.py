"""The driving world's scenes and its seeded scenario generator.

A straight multi-lane road along +x (lane i has its centre at y = (i + 0.5) W, lane 0 is the
rightmost, y grows to the left), an ego car and up to :data:`MAX_AGENTS` other cars. A scene is the
whole state at one time ``t``: the ego (x, y, heading, speed, acceleration), every other car
(x, y, heading, speed, its IDM parameters and its scripted lane change), the road (lanes, lane
width, speed limit) and the parameters of the flawed teacher that drives the ego in the logs.
Everything is batched: every field is a tensor whose first dimension is the scene.

A scenario is a pure function of (type, seed): every number it draws is a 32-bit integer hash of
(type, seed, draw index) (:func:`uniforms`), computed for a whole batch at once, so scenario 7 of
``cut-in`` is the same scene whatever else is generated with it, on every machine.

Scenario types (:data:`TYPES`): ``free`` (a few cars, far), ``slow-lead`` (a slow car ahead in the
ego's lane; the next lane lets the ego pass), ``stopped`` (a stopped car ahead in the ego's lane),
``cut-in`` (a slower car in the next lane, just ahead, changes into the ego's lane), ``dense``
(many slower cars on 3-4 lanes, some of them changing lanes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch

TYPES = ("free", "slow-lead", "stopped", "cut-in", "dense")
LANE_WIDTH = 3.5
CAR_LENGTH = 4.5
CAR_WIDTH = 1.8
WHEELBASE = 2.7
MAX_AGENTS = 12
SPEED_LIMITS = (22.0, 25.0, 28.0, 31.0, 33.0)
FAR = 1.0e4  #: where an absent car is parked (x), so it is nobody's leader
#: the largest scenario seed: seeds live in int64 tensors (``Scene.seed``, the hash of :func:`uniforms`)
MAX_SEED = 2**63 - 1
SEED_RANGE = f"an integer from 0 to 2**63 - 1 ({MAX_SEED})"
#: the fastest a car of a scene may drive, or a road allow [m/s]: the generated limits are at most
#: 33 m/s and the fastest teacher drives 1.08 x its limit; 60 m/s (216 km/h) leaves room for
#: speeders of your own while a 4 s plan still ends within 300 m of the ego
MAX_SPEED = 60.0
#: the farthest a car of a scene may start from the ego [m]: the generator places them 70 m behind
#: to 150 m ahead and the scene encoding sees 100 m; 1 km keeps every car far from FAR (where absent
#: cars are parked) and its float32 position exact to a millimetre
MAX_DISTANCE = 1000.0
#: teacher parameters, in the order of ``Scene.teacher``
TEACHER_KEYS = (
    "speed_factor",
    "headway",
    "changes_lanes",
    "politeness",
    "wobble",
    "wobble_frequency",
    "wobble_phase",
    "perception",
    "cut_in_threshold",
)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    m = 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & m
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def uniforms(kinds: torch.Tensor, seeds: torch.Tensor, count: int) -> torch.Tensor:
    """(B, count) float64 in [0, 1): the draws of scenarios (kind, seed), a pure function of them."""
    kinds = torch.as_tensor(kinds, dtype=torch.int64).reshape(-1, 1)
    seeds = torch.as_tensor(seeds, dtype=torch.int64).reshape(-1, 1)
    base = _fmix32((seeds & 0xFFFFFFFF) ^ ((kinds * 0x9E3779B9) & 0xFFFFFFFF))
    k = torch.arange(count, dtype=torch.int64).reshape(1, -1)
    h = _fmix32(base ^ ((k * 0x27D4EB2F + 0x165667B1) & 0xFFFFFFFF))
    h = _fmix32(h ^ (seeds >> 32 & 0xFFFFFFFF))
    return h.double() / 4294967296.0


@attrs.define(eq=False)
class Scene:
    """A batch of scenes (every field batch-first, float32 unless said otherwise)."""

    t: torch.Tensor  # (B,) seconds since the scenario began
    ego: torch.Tensor  # (B, 5) x, y, heading, speed, acceleration
    agents: torch.Tensor  # (B, N, 4) x, y, heading, speed
    valid: torch.Tensor  # (B, N) bool: the car exists
    idm: torch.Tensor  # (B, N, 5) desired speed, time headway, minimum gap, max acceleration, comfortable deceleration
    lane_change: torch.Tensor  # (B, N, 4) from y, to y, start time, duration (0: keeps its lane)
    road: torch.Tensor  # (B, 3) lanes, lane width, speed limit
    teacher: torch.Tensor  # (B, len(TEACHER_KEYS)) the teacher's (flawed) parameters
    kind: torch.Tensor  # (B,) long: index into TYPES
    seed: torch.Tensor  # (B,) long
    previous_plan: torch.Tensor  # (B, T, 2) world-frame waypoints of the plan made before this scene (NaN: none)

    FIELDS = ("t", "ego", "agents", "valid", "idm", "lane_change", "road", "teacher", "kind", "seed", "previous_plan")

    def __len__(self) -> int:
        return int(self.t.shape[0])

    def map(self, fn: Any) -> Scene:
        return Scene(**{f: fn(getattr(self, f)) for f in self.FIELDS})

    def index(self, rows: Any) -> Scene:
        return self.map(lambda v: v[rows])

    def replace(self, **changes: torch.Tensor) -> Scene:
        return attrs.evolve(self, **changes)

    @staticmethod
    def cat(scenes: Sequence[Scene]) -> Scene:
        return Scene(**{f: torch.cat([getattr(s, f) for s in scenes]) for f in Scene.FIELDS})

    @property
    def lanes(self) -> torch.Tensor:
        return self.road[:, 0]

    @property
    def lane_width(self) -> torch.Tensor:
        return self.road[:, 1]

    @property
    def speed_limit(self) -> torch.Tensor:
        return self.road[:, 2]

    def teacher_param(self, name: str) -> torch.Tensor:
        return self.teacher[:, TEACHER_KEYS.index(name)]

    def to_rows(self) -> list[dict[str, Any]]:
        """Each scene as plain lists (JSON), for checkpoints; :meth:`from_rows` reads them back."""
        return [{f: getattr(self, f)[b].tolist() for f in self.FIELDS} for b in range(len(self))]

    @staticmethod
    def from_rows(rows: Sequence[dict[str, Any]]) -> Scene:
        dtypes = {"valid": torch.bool, "kind": torch.long, "seed": torch.long}
        return Scene(
            **{f: torch.tensor([r[f] for r in rows], dtype=dtypes.get(f, torch.float32)) for f in Scene.FIELDS}
        )


def lane_centre(lane: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    return (lane + 0.5) * width


def nearest_lane(y: torch.Tensor, lanes: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """The index (float) of the lane whose centre is nearest to ``y``, inside the road."""
    return torch.minimum(torch.clamp(torch.floor(y / width), min=0), lanes - 1)


# --- the generator -------------------------------------------------------------------------------

HORIZON_STEPS = 8  #: waypoints of a plan
PLAN_DT = 0.5  #: seconds between waypoints


def generate(kinds: Sequence[int] | torch.Tensor, seeds: Sequence[int] | torch.Tensor) -> Scene:
    """The scenarios (``TYPES[kind]``, seed) at t = 0, batched (see the module docstring)."""
    kinds = torch.as_tensor(kinds, dtype=torch.long).reshape(-1)
    seeds = torch.as_tensor(seeds, dtype=torch.long).reshape(-1)
    if kinds.shape != seeds.shape:
        raise ValueError(f"{kinds.shape[0]} scenario types but {seeds.shape[0]} seeds")
    if bool((kinds < 0).any()) or bool((kinds >= len(TYPES)).any()) or bool((seeds < 0).any()):
        raise ValueError(f"scenario types are 0..{len(TYPES) - 1} and seeds >= 0")
    b, n = kinds.shape[0], MAX_AGENTS
    u = uniforms(kinds, seeds, 32 + 8 * n).float()
    g = u[:, :32]
    a = u[:, 32:].reshape(b, n, 8)
    is_ = {name: kinds == i for i, name in enumerate(TYPES)}

    lanes = torch.where(is_["dense"], 3 + torch.floor(g[:, 0] * 2), 2 + torch.floor(g[:, 0] * 3))
    width = torch.full((b,), LANE_WIDTH)
    limit = torch.tensor(SPEED_LIMITS)[torch.floor(g[:, 1] * len(SPEED_LIMITS)).long()]
    ego_lane = torch.floor(g[:, 2] * lanes)
    ego_v = limit * torch.where(is_["dense"], 0.45 + 0.25 * g[:, 3], 0.55 + 0.35 * g[:, 3])
    ego = torch.stack([torch.zeros(b), lane_centre(ego_lane, width), torch.zeros(b), ego_v, torch.zeros(b)], 1)

    # the flawed teacher: its own desired speed and headway, 30 % never change lanes, a lateral
    # wobble, a short sight and, for half of them, a late reaction to cars cutting in
    teacher = torch.stack(
        [
            0.85 + 0.23 * g[:, 10],  # desired speed / limit (some drive faster than the limit)
            0.7 + 1.1 * g[:, 11],  # time headway [s]
            (g[:, 12] >= 0.3).float(),  # changes lanes at all
            0.5 * g[:, 13],  # MOBIL politeness
            0.35 * g[:, 14],  # wobble amplitude [m]
            0.3 + 0.5 * g[:, 15],  # wobble frequency [rad/s]
            2 * math.pi * g[:, 16],  # wobble phase
            35.0 + 55.0 * g[:, 17],  # perception range [m]
            torch.where(
                g[:, 18] < 0.5, 0.9 + 0.4 * g[:, 19], torch.full((b,), 2.0)
            ),  # |dy| under which a car is a leader
        ],
        1,
    )

    # other cars: lane, position, speed by scenario type (slot 0 is the type's special car)
    lane = torch.floor(a[..., 0] * lanes[:, None])
    x = -70.0 + 220.0 * a[..., 1]
    v = limit[:, None] * (0.6 + 0.4 * a[..., 2])
    count = torch.where(
        is_["free"],
        torch.floor(g[:, 20] * 4),
        torch.where(is_["dense"], 8 + torch.floor(g[:, 20] * 5), 1 + torch.floor(g[:, 20] * 4)),
    )
    exists = torch.arange(n)[None] < count[:, None] + (~is_["free"]).float()[:, None]  # slot 0 plus count others
    exists[:, 0] = ~is_["free"] | (count > 0)
    far = is_["free"][:, None] & (x.abs() < 50)
    x = torch.where(far, torch.sign(x + 1e-3) * (50 + x.abs()), x)
    dense = is_["dense"][:, None]
    v = torch.where(dense, limit[:, None] * (0.4 + 0.3 * a[..., 2]), v)
    static = torch.zeros(b, n, dtype=torch.bool)

    side = torch.where(ego_lane + 1 < lanes, ego_lane + 1, ego_lane - 1)  # the next lane (left if there is one)
    special = {
        "slow-lead": (ego_lane, 25.0 + 30.0 * g[:, 21], limit * (0.3 + 0.25 * g[:, 22])),
        "stopped": (ego_lane, 60.0 + 50.0 * g[:, 21], torch.zeros(b)),
        "cut-in": (side, 12.0 + 20.0 * g[:, 21], ego_v * (0.82 + 0.18 * g[:, 22])),
    }
    for name, (l0, x0, v0) in special.items():
        m = is_[name]
        lane[:, 0] = torch.where(m, l0, lane[:, 0])
        x[:, 0] = torch.where(m, x0, x[:, 0])
        v[:, 0] = torch.where(m, v0, v[:, 0])
    static[:, 0] = is_["stopped"]

    # scripted lane changes: the cut-in car into the ego's lane; 20 % of dense traffic to a neighbour
    from_y = lane_centre(lane, width[:, None])
    to_lane = lane.clone()
    start = torch.zeros(b, n)
    duration = torch.zeros(b, n)
    cut = is_["cut-in"]
    to_lane[:, 0] = torch.where(cut, ego_lane, to_lane[:, 0])
    # the cut begins while the car is still 12 m ahead (centre to centre) at constant speeds
    closing = (ego_v - v[:, 0]).clamp_min(0.1)
    start[:, 0] = torch.where(
        cut, torch.minimum(0.5 + 1.5 * g[:, 23], ((x[:, 0] - 12.0) / closing).clamp_min(0.2)), start[:, 0]
    )
    duration[:, 0] = torch.where(cut, 2.0 + 1.0 * g[:, 24], duration[:, 0])
    wanders = dense & (a[..., 3] < 0.2)
    neighbour = torch.where(a[..., 4] < 0.5, lane - 1, lane + 1)
    neighbour = torch.where((neighbour < 0) | (neighbour >= lanes[:, None]), 2 * lane - neighbour, neighbour)
    to_lane = torch.where(wanders, neighbour, to_lane)
    start = torch.where(wanders, 1.0 + 8.0 * a[..., 5], start)
    duration = torch.where(wanders, 3.0 + a[..., 6], duration)
    to_y = lane_centre(to_lane, width[:, None])

    # keep apart: a car within 14 m of the ego or of an earlier car in its lane is left out
    # (the type's special car is kept; the cut-in car starts beside the ego, in the next lane)
    keep = exists.clone()
    for i in range(n):
        clash = (lane[:, i] == ego_lane) & ((x[:, i]).abs() < 14.0)
        for j in range(i):
            clash = clash | (keep[:, j] & (lane[:, j] == lane[:, i]) & ((x[:, j] - x[:, i]).abs() < 14.0))
        if i == 0:
            clash = clash & is_["free"]
        keep[:, i] = keep[:, i] & ~clash
    # the stopped car: the next lane stays open 30 m around it, so it can be passed
    open_lane = is_["stopped"][:, None] & (lane == side[:, None]) & ((x - x[:, :1]).abs() < 30.0)
    open_lane[:, 0] = False
    keep = keep & ~open_lane

    y = from_y
    x = torch.where(keep, x, torch.full_like(x, FAR))
    v = torch.where(keep, v, torch.zeros_like(v))
    agents = torch.stack([x, y, torch.zeros_like(x), v], -1)
    idm = torch.stack(
        [
            torch.where(static, torch.zeros_like(v), v),  # desired speed: they cruise at their speed
            1.0 + 0.8 * a[..., 5],
            torch.full_like(v, 2.0),
            torch.full_like(v, 1.5),
            torch.full_like(v, 2.0),
        ],
        -1,
    )
    lane_change = torch.stack([from_y, to_y, start, duration], -1)
    road = torch.stack([lanes, width, limit], 1)
    return Scene(
        t=torch.zeros(b),
        ego=ego,
        agents=agents,
        valid=keep,
        idm=idm,
        lane_change=lane_change,
        road=road,
        teacher=teacher,
        kind=kinds,
        seed=seeds,
        previous_plan=torch.full((b, HORIZON_STEPS, 2), float("nan")),
    )
