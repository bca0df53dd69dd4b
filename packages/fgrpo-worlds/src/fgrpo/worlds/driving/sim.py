"""Kinematics of the driving world, batched in torch: other cars (IDM along their lane, scripted lane
changes), the ego (a kinematic bicycle), a tracking controller that executes a plan, the flawed
IDM+MOBIL teacher, collisions between oriented boxes and time to collision.

Units: metres, seconds, radians. The simulation step is :data:`DT` = 0.1 s. A plan is (T, 2)
waypoints at 0.5 s, 1.0 s, ... in the ego's frame at the time it was made (x forward, y left).
"""

from __future__ import annotations

import math

import attrs
import torch

from fgrpo.worlds.driving.world import (
    CAR_LENGTH,
    CAR_WIDTH,
    FAR,
    PLAN_DT,
    WHEELBASE,
    Scene,
    lane_centre,
    nearest_lane,
)

DT = 0.1
A_MIN, A_MAX = -8.0, 4.0  #: the ego's acceleration limits
STEER_MAX = 0.5
SAME_LANE = 2.0  #: |dy| under which a car ahead is a leader (IDM)
IDM_DELTA = 4.0


# --- other cars ---------------------------------------------------------------------------------


def smoothstep(s: torch.Tensor) -> torch.Tensor:
    s = s.clamp(0.0, 1.0)
    return s * s * (3 - 2 * s)


def scripted_y(scene: Scene, t: torch.Tensor) -> torch.Tensor:
    """(B, N) the lateral position of every other car at time ``t`` (B,): its lane, or the
    smoothstep between two lanes while its scripted lane change runs."""
    from_y, to_y, start, duration = scene.lane_change.unbind(-1)
    progress = torch.where(duration > 0, (t[:, None] - start) / duration.clamp_min(1e-6), torch.zeros_like(start))
    return from_y + (to_y - from_y) * smoothstep(progress)


def idm_acceleration(v: torch.Tensor, gap: torch.Tensor, dv: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """The intelligent driver model: a = a_max (1 - (v / v0)^4 - (s* / s)^2), s* = s0 + v T +
    v dv / (2 sqrt(a_max b)), ``dv`` = v - v_leader, ``gap`` the bumper-to-bumper distance (inf:
    no leader). params (..., 5): v0, T, s0, a_max, b. A car whose desired speed is 0 stands still."""
    v0, headway, s0, a_max, b = params.unbind(-1)
    free = 1 - (v / v0.clamp_min(0.1)).pow(IDM_DELTA)
    s_star = s0 + (v * headway + v * dv / (2 * torch.sqrt(a_max * b))).clamp_min(0)
    interaction = torch.where(torch.isfinite(gap), (s_star / gap.clamp_min(0.1)).pow(2), torch.zeros_like(gap))
    a = a_max * (free - interaction)
    return torch.where(v0 > 0, a, torch.minimum(a, torch.zeros_like(a)))


def leaders(
    x: torch.Tensor,
    y: torch.Tensor,
    v: torch.Tensor,
    exists: torch.Tensor,
    lateral: float | torch.Tensor = SAME_LANE,
    reach: float | torch.Tensor = math.inf,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each car i of (B, M) cars: the bumper gap to its leader (the nearest existing car ahead
    with |dy| < ``lateral`` within ``reach`` m, centre to centre) and the leader's speed;
    gap inf where there is none."""
    dx = x[:, None, :] - x[:, :, None]  # [b, i, j] = x_j - x_i
    dy = (y[:, None, :] - y[:, :, None]).abs()
    lateral = torch.as_tensor(lateral, dtype=x.dtype)
    reach = torch.as_tensor(reach, dtype=x.dtype)
    lateral = lateral.reshape(-1, 1, 1) if lateral.dim() else lateral
    reach = reach.reshape(-1, 1, 1) if reach.dim() else reach
    ahead = (dx > 0) & (dy < lateral) & exists[:, None, :] & (dx < reach)
    dist = torch.where(ahead, dx, torch.full_like(dx, math.inf))
    nearest, j = dist.min(dim=2)
    gap = nearest - CAR_LENGTH
    return gap, torch.gather(v, 1, j)


def step_agents(scene: Scene, reactive: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The other cars one step on: (agents (B, N, 4) at t + DT, their accelerations). With
    ``reactive`` the ego counts as a leader for them (closed loop); without, they drive as if it
    were not there (the non-reactive simulation of a plan)."""
    x, y, _, v = scene.agents.unbind(-1)
    ex, ey, _, ev, _ = scene.ego.unbind(-1)
    if reactive:
        xs = torch.cat([x, ex[:, None]], 1)
        ys = torch.cat([y, ey[:, None]], 1)
        vs = torch.cat([v, ev[:, None]], 1)
        exists = torch.cat([scene.valid, torch.ones_like(scene.valid[:, :1])], 1)
        gap, lead_v = leaders(xs, ys, vs, exists)
        gap, lead_v = gap[:, :-1], lead_v[:, :-1]
    else:
        gap, lead_v = leaders(x, y, v, scene.valid)
    a = idm_acceleration(v, gap, v - lead_v, scene.idm).clamp(-9.0, 3.0)
    a = torch.where(scene.valid, a, torch.zeros_like(a))
    v_next = (v + a * DT).clamp_min(0.0)
    x_next = x + 0.5 * (v + v_next) * DT
    t_next = scene.t + DT
    y_next = torch.where(scene.valid, scripted_y(scene, t_next), y)
    heading = torch.atan2(y_next - y, (x_next - x).clamp_min(1e-3))
    x_next = torch.where(scene.valid, x_next, torch.full_like(x_next, FAR))
    return torch.stack([x_next, y_next, heading, v_next], -1), a


# --- the ego ------------------------------------------------------------------------------------


def bicycle(ego: torch.Tensor, accel: torch.Tensor, steer: torch.Tensor) -> torch.Tensor:
    """One DT step of a kinematic bicycle (reference point at the car's centre): the new
    (x, y, heading, speed, acceleration) with the acceleration and steering clamped to their
    limits and the speed kept >= 0."""
    x, y, psi, v, _ = ego.unbind(-1)
    a = accel.clamp(A_MIN, A_MAX)
    delta = steer.clamp(-STEER_MAX, STEER_MAX)
    v_next = (v + a * DT).clamp_min(0.0)
    a = (v_next - v) / DT  # what was applied (a stop does not go on braking)
    v_mid = 0.5 * (v + v_next)
    psi_next = psi + v_mid * torch.tan(delta) / WHEELBASE * DT
    psi_mid = 0.5 * (psi + psi_next)
    return torch.stack(
        [x + v_mid * torch.cos(psi_mid) * DT, y + v_mid * torch.sin(psi_mid) * DT, psi_next, v_next, a], -1
    )


def plan_to_world(plan: torch.Tensor, ego: torch.Tensor) -> torch.Tensor:
    """(B, T, 2) waypoints in the ego frame of ``ego`` (B, 5) -> world frame."""
    x, y, psi = ego[:, 0:1], ego[:, 1:2], ego[:, 2:3]
    c, s = torch.cos(psi), torch.sin(psi)
    px, py = plan[..., 0], plan[..., 1]
    return torch.stack([x + c * px - s * py, y + s * px + c * py], -1)


def world_to_frame(points: torch.Tensor, ego: torch.Tensor) -> torch.Tensor:
    """(B, ..., 2) world points -> the ego frame of ``ego`` (B, 5)."""
    shape = (-1,) + (1,) * (points.dim() - 2)
    dx = points[..., 0] - ego[:, 0].reshape(shape)
    dy = points[..., 1] - ego[:, 1].reshape(shape)
    c, s = torch.cos(ego[:, 2]).reshape(shape), torch.sin(ego[:, 2]).reshape(shape)
    return torch.stack([c * dx + s * dy, -s * dx + c * dy], -1)


def _interpolate(path: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """(B, T + 1, 2) points at 0, PLAN_DT, ... -> the points at times ``tau`` (B, K), linear
    between waypoints and extrapolated along the last segment after the end: (B, K, 2)."""
    steps = path.shape[1] - 1
    pos = (tau / PLAN_DT).clamp(0.0, None)
    k = pos.floor().clamp(max=steps - 1).long()
    frac = (pos - k.to(pos.dtype))[..., None]
    a = torch.gather(path, 1, k[..., None].expand(-1, -1, 2))
    b = torch.gather(path, 1, (k + 1)[..., None].expand(-1, -1, 2))
    return a + (b - a) * frac


@attrs.frozen
class Reference:
    """What the tracking controller follows, precomputed for every step k of a plan (B, K):
    the plan's point, speed and acceleration at k DT (finite differences over PLAN_DT) and its
    point 0.8 s further (the pure-pursuit target)."""

    here: torch.Tensor  # (B, K, 2)
    speed: torch.Tensor  # (B, K)
    accel: torch.Tensor  # (B, K)
    target: torch.Tensor  # (B, K, 2)

    @staticmethod
    def of(path: torch.Tensor, steps: int) -> Reference:
        """``path`` (B, T+1, 2): the plan's world-frame points at 0, 0.5, ... s after it was made."""
        tau = (torch.arange(steps + 1, dtype=path.dtype) * DT)[None].expand(path.shape[0], -1)
        half = 0.5 * PLAN_DT

        def speed(at: torch.Tensor) -> torch.Tensor:
            lo = (at - half).clamp_min(0)
            return (_interpolate(path, at + half) - _interpolate(path, lo)).norm(dim=-1) / (at + half - lo)

        lo = (tau - half).clamp_min(0)
        accel = (speed(tau + half) - speed(lo)) / (tau + half - lo)
        return Reference(
            here=_interpolate(path, tau), speed=speed(tau), accel=accel, target=_interpolate(path, tau + 0.8)
        )


def track(ego: torch.Tensor, reference: Reference, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tracking controller at step ``k`` of a plan: (acceleration, steering) that make the ego
    follow it. Longitudinal: the plan's acceleration as feed-forward, plus 1.0 x the speed error
    and 0.5 x the along-track position error. Lateral: pure pursuit of the plan's point 0.8 s
    ahead (no steering while it is under 4 m away)."""
    x, y, psi, v, _ = ego.unbind(-1)
    heading = torch.stack([torch.cos(psi), torch.sin(psi)], 1)
    position = ego[:, :2]
    along = ((reference.here[:, k] - position) * heading).sum(1)
    accel = reference.accel[:, k] + 1.0 * (reference.speed[:, k] - v) + 0.5 * along
    offset = reference.target[:, k] - position
    distance = offset.norm(dim=1)
    alpha = torch.atan2(offset[:, 1], offset[:, 0]) - psi
    alpha = torch.atan2(torch.sin(alpha), torch.cos(alpha))
    steer = torch.where(
        distance >= 4.0, torch.atan(2 * WHEELBASE * torch.sin(alpha) / distance.clamp_min(4.0)), torch.zeros_like(psi)
    )
    return accel, steer


def plan_path(plan: torch.Tensor, ego: torch.Tensor) -> torch.Tensor:
    """(B, T+1, 2) world-frame points of a plan made at ``ego``: the ego's position, then the waypoints."""
    return torch.cat([ego[:, None, :2], plan_to_world(plan, ego)], 1)


# --- the teacher ---------------------------------------------------------------------------------


def _lane_leader(
    scene: Scene, lane: torch.Tensor, lateral: torch.Tensor, reach: torch.Tensor, behind: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The nearest car ahead (or ``behind``) of the ego in ``lane`` (B,): (bumper gap, its speed);
    a car counts when its centre is within ``lateral`` of that lane's centre and ``reach`` m."""
    x, y, _, v = scene.agents.unbind(-1)
    centre = lane_centre(lane, scene.lane_width)
    dx = (x - scene.ego[:, :1]) * (-1.0 if behind else 1.0)
    inside = scene.valid & ((y - centre[:, None]).abs() < lateral[:, None]) & (dx > 0) & (dx < reach[:, None])
    inside = inside & (lane >= 0)[:, None] & (lane < scene.lanes)[:, None]
    dist = torch.where(inside, dx, torch.full_like(dx, math.inf))
    nearest, j = dist.min(1)
    return nearest - CAR_LENGTH, torch.gather(v, 1, j[:, None])[:, 0]


#: the teacher's parameters without its flaws: the limit, a 1.2 s headway, lane changes, no wobble,
#: 150 m of sight and every car that enters the lane a leader
EXPERT = {
    "speed_factor": 1.0,
    "headway": 1.2,
    "changes_lanes": 1.0,
    "politeness": 0.25,
    "wobble": 0.0,
    "wobble_frequency": 0.5,
    "wobble_phase": 0.0,
    "perception": 150.0,
    "cut_in_threshold": SAME_LANE,
}


def without_flaws(scene: Scene) -> Scene:
    """``scene`` with the teacher's parameters replaced by :data:`EXPERT`."""
    from fgrpo.worlds.driving.world import TEACHER_KEYS

    expert = torch.tensor([EXPERT[k] for k in TEACHER_KEYS], dtype=scene.teacher.dtype)
    return scene.replace(teacher=expert.expand_as(scene.teacher).clone())


def teacher_control(scene: Scene) -> tuple[torch.Tensor, torch.Tensor]:
    """The flawed teacher, a memoryless IDM + MOBIL driver: (acceleration, steering) at ``scene``.

    Its flaws come from ``scene.teacher``: its own desired speed (0.85-1.08 x the limit) and time
    headway (0.7-1.8 s); 30 % of them never change lanes; a lateral wobble; it sees cars only
    within its perception range (35-90 m), and half of them take a car cutting in for a leader
    only once it is well inside the lane (|dy| < 0.9-1.3 m instead of 2 m)."""
    ego = scene.ego
    x, y, psi, v, _ = ego.unbind(-1)
    lanes, width, limit = scene.lanes, scene.lane_width, scene.speed_limit
    p = {
        k: scene.teacher_param(k)
        for k in (
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
    }
    params = torch.stack(
        [
            p["speed_factor"] * limit,
            p["headway"],
            torch.full_like(v, 2.0),
            torch.full_like(v, 2.0),
            torch.full_like(v, 2.5),
        ],
        -1,
    )
    reach = p["perception"]
    lateral = p["cut_in_threshold"]
    current = nearest_lane(y, lanes, width)

    def accel_in(lane: torch.Tensor) -> torch.Tensor:
        gap, lead_v = _lane_leader(scene, lane, lateral, reach)
        return idm_acceleration(v, gap, v - lead_v, params)

    a_here = accel_in(current)
    best, best_gain = current.clone(), torch.full_like(v, 0.3)  # MOBIL's switching threshold [m/s^2]
    for direction in (1.0, -1.0):
        lane = current + direction
        possible = (lane >= 0) & (lane < lanes) & (p["changes_lanes"] > 0)
        # the new follower: before and after the change, and the gaps to both neighbours
        back_gap, back_v = _lane_leader(
            scene, lane, torch.full_like(v, SAME_LANE), torch.full_like(v, 60.0), behind=True
        )
        front_gap, _ = _lane_leader(scene, lane, torch.full_like(v, SAME_LANE), reach)
        follower = torch.stack(
            [
                back_v,
                torch.full_like(v, 1.2),
                torch.full_like(v, 2.0),
                torch.full_like(v, 1.5),
                torch.full_like(v, 2.0),
            ],
            -1,
        )
        after = idm_acceleration(back_v, back_gap, back_v - v, follower)
        safe = (after > -4.0) & (back_gap > 3.0) & (front_gap > 4.0)
        gain = accel_in(lane) - a_here + p["politeness"] * torch.minimum(after, torch.zeros_like(after))
        take = possible & safe & (gain > best_gain)
        best = torch.where(take, lane, best)
        best_gain = torch.where(take, gain, best_gain)
    accel = torch.minimum(a_here, accel_in(best))
    target_y = lane_centre(best, width) + p["wobble"] * torch.sin(p["wobble_frequency"] * scene.t + p["wobble_phase"])
    ahead = torch.clamp(1.5 * v, min=8.0)
    alpha = torch.atan2(target_y - y, ahead) - psi
    steer = torch.atan(2 * WHEELBASE * torch.sin(alpha) / torch.sqrt(ahead**2 + (target_y - y) ** 2))
    return accel, steer


# --- stepping the world -----------------------------------------------------------------------------


def advance(scene: Scene, accel: torch.Tensor, steer: torch.Tensor, reactive: bool) -> Scene:
    """The whole scene one DT on: the others by IDM (seeing the ego when ``reactive``), the ego by
    the bicycle under (accel, steer)."""
    agents, _ = step_agents(scene, reactive)
    return scene.replace(t=scene.t + DT, ego=bicycle(scene.ego, accel, steer), agents=agents)


def ego_corners(ego: torch.Tensor) -> torch.Tensor:
    """(..., 4, 2) the corners of the ego's box for (..., 5) states."""
    return box_corners(ego[..., 0], ego[..., 1], ego[..., 2])


def box_corners(x: torch.Tensor, y: torch.Tensor, psi: torch.Tensor) -> torch.Tensor:
    c, s = torch.cos(psi), torch.sin(psi)
    hl, hw = CAR_LENGTH / 2, CAR_WIDTH / 2
    out = []
    for sl, sw in ((1, 1), (1, -1), (-1, -1), (-1, 1)):
        out.append(torch.stack([x + c * sl * hl - s * sw * hw, y + s * sl * hl + c * sw * hw], -1))
    return torch.stack(out, -2)


def boxes_overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether car boxes overlap (separating-axis test): a and b broadcastable (..., 3) of
    (x, y, heading), every car CAR_LENGTH x CAR_WIDTH."""
    d = b[..., :2] - a[..., :2]
    hl, hw = CAR_LENGTH / 2, CAR_WIDTH / 2
    overlap = torch.ones(torch.broadcast_shapes(a.shape[:-1], b.shape[:-1]), dtype=torch.bool)
    for axis_of in (a, b):
        for angle in (axis_of[..., 2], axis_of[..., 2] + math.pi / 2):
            ux, uy = torch.cos(angle), torch.sin(angle)
            distance = (d[..., 0] * ux + d[..., 1] * uy).abs()
            ra = hl * (torch.cos(a[..., 2] - angle)).abs() + hw * (torch.sin(a[..., 2] - angle)).abs()
            rb = hl * (torch.cos(b[..., 2] - angle)).abs() + hw * (torch.sin(b[..., 2] - angle)).abs()
            overlap = overlap & (distance <= ra + rb)
    return overlap


def collisions(ego: torch.Tensor, agents: torch.Tensor, valid: torch.Tensor, *, at_fault_only: bool) -> torch.Tensor:
    """(B,) bool per step for (B, 5) ego states and (B, N, 4) cars: the ego's box overlaps a car's.
    ``at_fault_only``: a car that runs into the ego's back from behind, in its lane, does not count
    (the non-reactive simulation's others do not brake for the ego)."""
    a = ego[:, None, :3]
    b = agents[..., :3]
    hit = boxes_overlap(a, b) & valid
    if at_fault_only:
        rel = world_to_frame(agents[..., :2], ego)
        from_behind = (rel[..., 0] < -CAR_LENGTH / 2) & (rel[..., 1].abs() < CAR_WIDTH)
        hit = hit & ~from_behind
    return hit.any(1)


def off_road(ego: torch.Tensor, lanes: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """(B,) bool: a corner of the ego's box lies outside the road's edges (0 and lanes x width)."""
    y = ego_corners(ego)[..., 1]
    return (y < 0).any(-1) | (y > (lanes * width)[:, None]).any(-1)


def time_to_collision(ego: torch.Tensor, agents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B,) seconds until the ego's front meets the back of a car ahead in its lane (|dy| <
    car width, in the ego's frame) if both kept their speeds: gap / closing speed; inf when no car
    ahead is closing."""
    rel = world_to_frame(agents[..., :2], ego)
    ahead = valid & (rel[..., 0] > 0) & (rel[..., 1].abs() < CAR_WIDTH)
    gap = rel[..., 0] - CAR_LENGTH
    closing = ego[:, None, 3] - agents[..., 3] * torch.cos(agents[..., 2] - ego[:, None, 2])
    ttc = torch.where(
        ahead & (closing > 1e-6), gap.clamp_min(0) / closing.clamp_min(1e-6), torch.full_like(gap, math.inf)
    )
    return ttc.min(1).values


def agent_paths(scene: Scene, steps: int) -> torch.Tensor:
    """(B, steps + 1, N, 4) the other cars from ``scene`` on, non-reactive (they never see the
    ego, so one path serves every plan made in the same scene)."""
    out = [scene.agents]
    for _ in range(steps):
        agents, _ = step_agents(scene, reactive=False)
        scene = scene.replace(t=scene.t + DT, agents=agents)
        out.append(agents)
    return torch.stack(out, 1)


def simulate_plan(
    scene: Scene,
    plan: torch.Tensor,
    seconds: float,
    *,
    agents: torch.Tensor | None = None,
    reactive: bool = False,
) -> dict[str, torch.Tensor]:
    """Execute ``plan`` (B, T, 2) from ``scene`` for ``seconds`` with the tracking controller: the
    ego states (B, S+1, 5) from the start, the others (B, S+1, N, 4), and per step (B, S) the
    collision and off-road flags and the time to collision. The others drive non-reactively
    (``agents``: their precomputed :func:`agent_paths`) and only at-fault collisions count; with
    ``reactive`` they see the ego as the closed loop's do (each plan its own traffic) and every
    collision counts, as in the closed loop."""
    steps = int(round(seconds / DT))
    reference = Reference.of(plan_path(plan, scene.ego), steps)
    if reactive:
        egos, others = [scene.ego], [scene.agents]
        for k in range(steps):
            accel, steer = track(scene.ego, reference, k)
            scene = advance(scene, accel, steer, reactive=True)
            egos.append(scene.ego)
            others.append(scene.agents)
        agents = torch.stack(others, 1)
    else:
        agents = agent_paths(scene, steps) if agents is None else agents
        ego, egos = scene.ego, [scene.ego]
        for k in range(steps):
            accel, steer = track(ego, reference, k)
            ego = bicycle(ego, accel, steer)
            egos.append(ego)
    ego = torch.stack(egos, 1)
    b, s1 = ego.shape[:2]
    flat_ego = ego[:, 1:].reshape(b * (s1 - 1), 5)
    flat_agents = agents[:, 1:].reshape(b * (s1 - 1), *agents.shape[2:])
    valid = scene.valid.repeat_interleave(s1 - 1, 0)
    lanes, width = scene.lanes.repeat_interleave(s1 - 1), scene.lane_width.repeat_interleave(s1 - 1)
    return {
        "ego": ego,
        "agents": agents,
        "collision": collisions(flat_ego, flat_agents, valid, at_fault_only=not reactive).reshape(b, s1 - 1),
        "off_road": off_road(flat_ego, lanes, width).reshape(b, s1 - 1),
        "ttc": time_to_collision(flat_ego, flat_agents, valid).reshape(b, s1 - 1),
    }


def execute(scene: Scene, plan: torch.Tensor, seconds: float) -> tuple[Scene, list[Scene]]:
    """Closed loop: execute ``plan`` for ``seconds`` among reactive traffic (the others see the ego);
    (the scene at the end, the scenes after every step)."""
    steps = int(round(seconds / DT))
    reference = Reference.of(plan_path(plan, scene.ego), steps)
    out = []
    for k in range(steps):
        accel, steer = track(scene.ego, reference, k)
        scene = advance(scene, accel, steer, reactive=True)
        out.append(scene)
    return scene, out


def teacher_rollout(scene: Scene, steps: int, *, reactive: bool = True) -> list[Scene]:
    """The teacher driving from ``scene`` for ``steps`` DT: the scenes after each step."""
    out = []
    for _ in range(steps):
        accel, steer = teacher_control(scene)
        scene = advance(scene, accel, steer, reactive)
        out.append(scene)
    return out


def teacher_plan(scene: Scene) -> torch.Tensor:
    """(B, T, 2) what the teacher does from ``scene``: its positions 0.5, 1.0, ... 4.0 s later
    (reactive traffic), in the ego frame at ``scene`` (the log's future, for a log scene)."""
    from fgrpo.worlds.driving.world import HORIZON_STEPS

    per = int(round(PLAN_DT / DT))
    later = teacher_rollout(scene, HORIZON_STEPS * per)
    points = torch.stack([later[per * (k + 1) - 1].ego[:, :2] for k in range(HORIZON_STEPS)], 1)
    return world_to_frame(points, scene.ego)
