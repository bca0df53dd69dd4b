"""The ``mixgrpo`` sampler: the sliding window over iterations, its state, Flash."""

from __future__ import annotations

import json

import pytest
import torch

from fgrpo.core import registry


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def starts(sampler, iterations):
    out = []
    for it in iterations:
        sampler.advance(it)
        out.append(sampler.window_start)
    return out


def make(**keys):
    return registry.create("sampler", "mixgrpo", **keys)


def test_progressive_rollback_sequence():
    # 10 steps, window 4, window_end = 10 - 2 = 8 -> starts 0..4; shift every 2 iterations
    sampler = make(steps=10, window=4, shift_every=2)
    assert sampler.last_start == 4
    assert starts(sampler, range(14)) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 0, 0, 1, 1]
    # stride 2: 0, 2, 4, then 6 > 4 -> back to 0
    assert starts(make(steps=10, window=4, shift_every=1, stride=2), range(7)) == [0, 2, 4, 0, 2, 4, 0]
    # stride 3: 0, 3, then 6 > 4 -> back to 0
    assert starts(make(steps=10, window=4, shift_every=1, stride=3), range(5)) == [0, 3, 0, 3, 0]


def test_progressive_stay_sequence():
    sampler = make(steps=10, window=4, shift_every=2, at_end="stay")
    assert starts(sampler, range(14)) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 4, 4, 4]
    # stride 3: 0, 3, then clamped to the last allowed start 4
    assert starts(make(steps=10, window=4, shift_every=1, stride=3, at_end="stay"), range(5)) == [0, 3, 4, 4, 4]


def test_reference_defaults_25_steps():
    # MixGRPO: 25 steps, window 4, shift every 25 iterations, stride 1, roll back; window_end 23
    sampler = make(steps=25)
    assert (sampler.window, sampler.shift_every, sampler.stride, sampler.at_end) == (4, 25, 1, "rollback")
    assert sampler.last_start == 19
    assert starts(sampler, [0, 24, 25, 49, 50, 475, 499, 500]) == [0, 0, 1, 1, 2, 19, 19, 0]


def test_window_end_key():
    sampler = make(steps=10, window=2, window_end=10, shift_every=1)
    assert starts(sampler, range(10)) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 0]


def test_random_strategy_within_bounds_and_reproducible():
    a = make(steps=10, window=4, shift_every=3, strategy="random", seed=5)
    seq = starts(a, range(600))
    assert set(seq) == {0, 1, 2, 3, 4}  # inside [0, window_end - window]
    assert all(seq[i] == seq[i - i % 3] for i in range(600))  # moves only every shift_every
    assert starts(make(steps=10, window=4, shift_every=3, strategy="random", seed=5), range(600)) == seq
    assert starts(make(steps=10, window=4, shift_every=3, strategy="random", seed=6), range(600)) != seq
    # from a saved state, the sequence continues identically
    b = make(steps=10, window=4, shift_every=3, strategy="random", seed=5)
    a.advance(299)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.window_start == seq[299]
    assert starts(b, range(300, 600)) == seq[300:]


def test_state_dict_round_trip_mid_sequence(policy):
    keys = {"steps": 10, "window": 3, "shift_every": 4}
    a = make(**keys)
    starts(a, range(38))
    state = a.state_dict()
    assert state == {"iteration": 37, "window_start": 3}  # shift 9, cycle of 6 starts
    restored = make(**keys)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    traj_a = a.rollout(policy, ["a", "b"], 2, generator=gen(4))
    traj_b = restored.rollout(policy, ["a", "b"], 2, generator=gen(4))
    assert torch.equal(traj_a.final, traj_b.final) and torch.equal(traj_a.step_index, traj_b.step_index)
    assert starts(a, range(38, 80)) == starts(restored, range(38, 80))
    with pytest.raises(ValueError, match="window start"):
        make(**keys).load_state_dict({"iteration": 3, "window_start": 9})


def test_window_steps_use_the_kernel_and_the_rest_is_ode(policy):
    sampler = make(steps=10, window=3, shift_every=1)
    sampler.advance(2)
    traj = sampler.rollout(policy, ["a", "b"], 3, generator=gen())
    assert traj.step_index.tolist() == [[2, 3, 4]] * 6
    assert traj.info["phases"] == ["prefix"] * 2 + ["window"] * 3 + ["suffix"] * 5
    assert traj.info["window_start"] == 2 and traj.info["iteration"] == 2
    # shared initial noise: the group enters the window from one state (computed once per prompt)
    assert policy.rows == [2, 2] + [6] * 8
    assert torch.equal(traj.latents[0, 0], traj.latents[2, 0])
    assert not torch.equal(traj.next_latents[0, 0], traj.next_latents[2, 0])
    independent = make(steps=10, window=3, shift_every=1, share_noise=False)
    independent.advance(2)
    other = independent.rollout(policy, ["a", "b"], 3, generator=gen())
    assert not torch.equal(other.latents[0, 0], other.latents[2, 0])


def flash_replay(policy, traj, kernel_name):
    """The Flash tail recomputed: ``kernel_name`` on the compressed schedule from the window's last action."""
    compressed = torch.tensor(traj.info["flash_sigmas"])
    dpm = registry.create("kernel", kernel_name)
    x = traj.next_latents[:, -1]
    for j in range(len(compressed) - 1):
        v = policy.velocity(x, compressed[j].repeat(x.shape[0]), traj.cond)
        x = dpm.step(v, x, compressed, j).prev_sample
    return x


class Spy:
    """Wraps a kernel and records the sigma every step starts from."""

    def __init__(self, kernel):
        self.inner, self.stochastic, self.sigmas_seen, self.resets = kernel, kernel.stochastic, [], 0

    def reset(self):
        self.resets += 1
        self.inner.reset()

    def step(self, velocity, sample, sigmas, index, **kw):
        self.sigmas_seen.append(float(sigmas[index]))
        return self.inner.step(velocity, sample, sigmas, index, **kw)


@pytest.mark.parametrize("iteration", [0, 3, 5])
def test_flash_uses_dpm_only_after_the_window_and_fewer_nfe(policy, iteration):
    keys = {"steps": 25, "window": 4, "shift_every": 1, "window_end": 23}
    flash = make(flash=True, **keys)
    plain = make(**keys)
    flash.advance(iteration)
    plain.advance(iteration)
    flash._dpm = Spy(registry.create("kernel", "dpmpp2m"))
    a = flash.rollout(policy, ["a", "b"], 2, generator=gen())
    b = plain.rollout(policy, ["a", "b"], 2, generator=gen())
    start, last = iteration, iteration + 3
    sigmas = a.sigmas
    # DPM-Solver++ runs once, from the sigma reached after the window down to 0
    spy = flash._dpm
    assert spy.resets == 1
    assert spy.sigmas_seen[0] == float(sigmas[last + 1])
    assert all(s <= float(sigmas[last + 1]) for s in spy.sigmas_seen)
    points = int((25 - last) * 0.4)
    assert len(spy.sigmas_seen) == points - 1
    assert a.info["flash_sigmas"][0] == float(sigmas[last + 1]) and a.info["flash_sigmas"][-1] == 0.0
    phases = a.info["phases"]
    assert phases == ["prefix"] * start + ["window"] * 4 + ["flash"] * (points - 1)
    # the trained part is the same as without flash; only the tail is cheaper
    assert torch.equal(a.next_latents, b.next_latents) and torch.equal(a.log_probs, b.log_probs)
    assert a.nfe < b.nfe
    assert a.nfe == (start * 2 + (4 + points - 1) * 4)
    # the final latents are DPM-Solver++(2M) on the compressed schedule from the window's last action
    assert torch.equal(flash_replay(policy, a, "dpmpp2m"), a.final)


def test_flash_after_a_window_that_ends_the_schedule(policy):
    sampler = make(steps=6, window=2, window_end=6, flash=True, shift_every=1)
    sampler.advance(4)  # window [4, 6): nothing left after it
    traj = sampler.rollout(policy, ["a"], 2, generator=gen())
    assert traj.info["phases"] == ["prefix"] * 4 + ["window"] * 2
    assert "flash_sigmas" not in traj.info


def test_decay_strategy_dwells_less_at_lower_noise():
    # MixGRPO decay: iters at start p = max(min, int(max (1 - p/end) + min p/end)), end = steps - 2
    sampler = make(steps=10, window=2, shift_every=10, min_shift_every=2, strategy="decay")
    assert sampler.end == 8 and sampler.last_start == 6
    dwells = [sampler.dwell(p) for p in range(7)]
    assert dwells == [max(2, int(10 * (1 - p / 8) + 2 * p / 8)) for p in range(7)] == [10, 9, 8, 7, 6, 5, 4]
    seq = starts(sampler, range(sum(dwells) + 3))
    expected = [p for p, d in enumerate(dwells) for _ in range(d)]
    assert seq == expected + [0, 0, 0]  # rolls back
    # min_shift_every defaults to max(1, shift_every // 4), as the reference's class default
    assert make(steps=10, window=2, shift_every=10, strategy="decay").dwell(8) == 2


def test_exp_decay_strategy():
    # dwell = ceil(shift_every * exp(-k * relu(start - threshold)))
    sampler = make(steps=25, window=4, shift_every=5, strategy="exp_decay", decay_threshold=13, decay_rate=0.1)
    import math

    assert [sampler.dwell(p) for p in (0, 13, 14, 19)] == [
        5,
        5,
        math.ceil(5 * math.exp(-0.1)),
        math.ceil(5 * math.exp(-0.6)),
    ]
    seq = starts(sampler, range(200))
    assert seq[:65] == [p for p in range(13) for _ in range(5)]
    assert seq[65:70] == [13] * 5 and seq[70:75] == [14] * 5  # ceil(4.52) = 5
    stay = make(steps=25, window=4, shift_every=5, strategy="exp_decay", at_end="stay")
    assert starts(stay, [10_000]) == [19]


def test_shrinking_window_as_mixgrpo(policy):
    # MixGRPO: window = range(start, min(start + size, max)), starts up to max - 1 (empty at max skipped)
    sampler = make(steps=10, window=4, shift_every=1, shrink=True)
    assert sampler.last_start == 7
    assert starts(sampler, range(10)) == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert [sampler.window_at(p) for p in (4, 5, 7)] == [[4, 5, 6, 7], [5, 6, 7], [7]]
    sampler.advance(6)
    traj = sampler.rollout(policy, ["a"], 2, generator=gen())
    assert traj.step_index.tolist() == [[6, 7]] * 2
    # the state of a shrunk position round-trips
    other = make(steps=10, window=4, shift_every=1, shrink=True)
    other.load_state_dict(sampler.state_dict())
    assert other.window_start == 6


def test_flash_order_3_uses_dpmpp3m(policy):
    keys = {"steps": 25, "window": 4, "shift_every": 1, "flash": True}
    third = make(flash_order=3, **keys)
    second = make(**keys)
    a = third.rollout(policy, ["a"], 2, generator=gen())
    b = second.rollout(policy, ["a"], 2, generator=gen())
    assert type(third._dpm).__name__ == "DPMpp3MKernel" and type(second._dpm).__name__ == "DPMpp2MKernel"
    assert torch.equal(a.next_latents, b.next_latents)
    assert torch.equal(flash_replay(policy, a, "dpmpp3m"), a.final)
    assert not torch.equal(a.final, b.final)
