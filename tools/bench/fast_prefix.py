#!/usr/bin/env python
"""What sharing the ODE prefix saves in the ``fast`` sampler (Flow-GRPO-Fast).

With ``share_noise: true`` the group of G samples of a prompt shares its initial noise, so the ODE
steps before the window are the same for all G: ``share_prefix: true`` runs them once per prompt
and branches at the window start, ``share_prefix: false`` runs them for every sample. The NFE
saved by one rollout whose window starts at k is ``k x (G - 1) x prompts x evaluations/call``;
averaged over the window start (uniform in [0, steps // 2 - window], the default window range)
it is ``mean(k) x (G - 1) x prompts``.

The network is a stand-in with a measurable cost: a 3-layer MLP applied to every one of
``--tokens`` latent tokens of ``--dim`` features (prompt embedding and sigma added to the input),
like a transformer without attention: its cost grows with the rows it is given, as a diffusion
transformer's does at image sizes (with ``--tokens 1`` it is bound by reading its weights instead,
and a small batch costs almost as much as a large one). Both settings run in the same process, on the
same generator seeds (so on the same window starts), alternating, and the script prints the NFE
of both, their ratio and the ratio of wall times measured in this run.

    python tools/bench/fast_prefix.py --steps 10 --window 2 --group 8 --prompts 4 --repeats 20
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence

import torch

from fgrpo.core import registry


class MLPPolicy:
    """A Policy whose velocity is a random 3-layer MLP (no training, just realistic cost)."""

    def __init__(self, tokens: int, dim: int, hidden: int, guidance: float | None = None, seed: int = 0):
        torch.manual_seed(seed)
        self.device = torch.device("cpu")
        self.tokens = tokens
        self.dim = dim
        self.guidance = guidance
        self.evaluations_per_call = 1 if guidance is None else 2
        self.net = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden),
            torch.nn.SiLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.SiLU(),
            torch.nn.Linear(hidden, dim),
        ).requires_grad_(False)
        self.time = torch.randn(dim) / dim**0.5

    def encode(self, prompts: Sequence[str]) -> torch.Tensor:
        rows = [
            torch.randn(self.dim, generator=torch.Generator().manual_seed(zlib.crc32(p.encode()))) for p in prompts
        ]
        return torch.stack(rows)

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn((n, self.tokens, self.dim), generator=generator)

    def sigmas(self, steps: int) -> torch.Tensor:
        t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
        return (3.0 * t / (1 + 2.0 * t)).to(torch.float32)

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.net(x + cond[:, None] + sigma[:, None, None] * self.time)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        if self.guidance is None:
            return self._forward(x, sigma, cond)
        both = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([cond, torch.zeros_like(cond)]))
        v_cond, v_uncond = both.chunk(2)
        return v_uncond + self.guidance * (v_cond - v_uncond)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def trainable_parameters(self) -> Iterator[torch.nn.Parameter]:
        return iter(())

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        yield

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_trainable_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20, help="rollouts per setting (same seeds for both)")
    parser.add_argument("--tokens", type=int, default=64, help="latent tokens per sample")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--cfg", type=float, default=None, help="guidance scale (2 evaluations per call)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    policy = MLPPolicy(args.tokens, args.dim, args.hidden, args.cfg)
    prompts = [f"prompt {i}" for i in range(args.prompts)]
    samplers = {
        share: registry.create(
            "sampler", "fast", steps=args.steps, window=args.window, share_noise=True, share_prefix=share
        )
        for share in (True, False)
    }
    low, last = samplers[True].start_range
    high = last + 1
    epc = policy.evaluations_per_call

    for share in (True, False):  # warm-up
        samplers[share].rollout(policy, prompts, args.group, generator=torch.Generator().manual_seed(0))

    nfe: dict[bool, list[int]] = {True: [], False: []}
    seconds: dict[bool, list[float]] = {True: [], False: []}
    starts, max_diff = [], 0.0
    for r in range(args.repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        finals = {}
        for share in order:
            generator = torch.Generator().manual_seed(1000 + r)
            t0 = time.perf_counter()
            traj = samplers[share].rollout(policy, prompts, args.group, generator=generator)
            seconds[share].append(time.perf_counter() - t0)
            nfe[share].append(traj.nfe)
            finals[share] = traj.final
        starts.append(traj.info["window_start"])
        max_diff = max(max_diff, float((finals[True] - finals[False]).abs().max()))

    # the exact expectation over the window start, uniform in [low, high)
    batch = args.prompts * args.group
    full_nfe = args.steps * batch * epc
    expected_saving = statistics.mean(range(low, high)) * (args.group - 1) * args.prompts * epc

    shared_nfe, plain_nfe = statistics.mean(nfe[True]), statistics.mean(nfe[False])
    shared_s, plain_s = sum(seconds[True]), sum(seconds[False])
    print(
        f"fast sampler: steps {args.steps}, window {args.window}, window start uniform in [{low}, {high}), "
        f"group {args.group}, prompts {args.prompts}, evaluations/call {epc}, "
        f"MLP {args.dim}-{args.hidden}-{args.hidden}-{args.dim} on {args.tokens} tokens, {args.threads} thread(s), "
        f"{args.repeats} rollouts each"
    )
    print(f"window starts drawn: {starts}")
    print(f"NFE per rollout, share_prefix=false: {plain_nfe:.1f} (always {full_nfe})")
    print(f"NFE per rollout, share_prefix=true : {shared_nfe:.1f} (measured mean)")
    print(
        f"NFE saved per rollout: {plain_nfe - shared_nfe:.1f} measured; expected "
        f"mean(k) x (G - 1) x prompts x epc = {statistics.mean(range(low, high)):g} x {args.group - 1} x "
        f"{args.prompts} x {epc} = {expected_saving:g} ({expected_saving / full_nfe:.1%} of {full_nfe})"
    )
    print(f"NFE ratio shared/recomputed: {shared_nfe / plain_nfe:.3f} (expected {1 - expected_saving / full_nfe:.3f})")
    print(
        f"wall time: shared {shared_s / args.repeats * 1000:.1f} ms, recomputed {plain_s / args.repeats * 1000:.1f} "
        f"ms "
        f"per rollout; ratio shared/recomputed {shared_s / plain_s:.3f}"
    )
    print(
        f"max |final(shared) - final(recomputed)|: {max_diff:.3g} (0 when the network's rows do not depend on the "
        f"batch)"
    )


if __name__ == "__main__":
    main()
