#!/usr/bin/env python
"""Each transition kernel against a straightforward explicit implementation, on the same tensors.

    python tools/bench/kernel_formulas.py --batch 16 --shape 16 8 8 --repeats 200

The explicit versions are the formulas as the reference code writes them (flow_grpo's
``sde_step_with_logprob`` for ``sde`` and ``cps``, DanceGRPO's score form for ``dance``, the Euler
step for ``ode``, diffusers' ``DPMSolverMultistepScheduler`` for two ``dpmpp2m`` steps). For every
kernel the script prints the largest difference of mean and log-prob (evaluating a stored
action, as the update does) and the ratio of wall times fgrpo/explicit measured in this run,
calls interleaved. fgrpo's kernels check their inputs (index range, decreasing sigmas), which
costs a little on tiny tensors and nothing measurable on real latents.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import _bench  # noqa: E402 - beside this script: python puts a script's own folder first on sys.path


def explicit_sde(v, x, sigmas, i, x_next, eta):
    import torch

    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    dt = sigma_next - sigma
    std_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1], sigma))) * eta
    mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    s = std_t * torch.sqrt(-dt)
    lp = -((x_next - mean) ** 2) / (2 * s**2) - torch.log(s) - math.log(math.sqrt(2 * math.pi))
    return mean, lp.mean(dim=tuple(range(1, lp.ndim)))


def explicit_cps(v, x, sigmas, i, x_next, eta):
    import torch

    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    std_t = sigma_next * math.sin(eta * math.pi / 2)
    x0, x1 = x - sigma * v, x + v * (1 - sigma)
    mean = x0 * (1 - sigma_next) + x1 * torch.sqrt(sigma_next**2 - std_t**2)
    lp = -((x_next - mean) ** 2)
    return mean, lp.mean(dim=tuple(range(1, lp.ndim)))


def explicit_dance(v, x, sigmas, i, x_next, eta):
    import torch

    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    dt = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - x0 * (1 - sigma)) / sigma**2
    mean = x + dt * v - 0.5 * eta**2 * score * dt
    s = eta * torch.sqrt(-dt)
    lp = -((x_next - mean) ** 2) / (2 * s**2) - torch.log(s) - math.log(math.sqrt(2 * math.pi))
    return mean, lp.mean(dim=tuple(range(1, lp.ndim)))


def explicit_ode(v, x, sigmas, i, x_next, eta):
    import torch

    mean = x + (sigmas[i + 1] - sigmas[i]) * v
    return mean, torch.zeros(x.shape[0])


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--shape", type=int, nargs="+", default=[16, 8, 8], help="one sample's shape")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    _bench.choose_threads()
    import torch

    from fgrpo.core import registry

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, *args.shape, generator=g)
    v = torch.randn(args.batch, *args.shape, generator=g)
    t = torch.linspace(1, 0, args.steps + 1)
    sigmas = 3 * t / (1 + 2 * t)
    i = 2
    cases = {
        "sde": ({"eta": 0.7}, explicit_sde, 0.7),
        "cps": ({"eta": 0.8}, explicit_cps, 0.8),
        "dance": ({"eta": 0.3}, explicit_dance, 0.3),
        "euler": ({}, explicit_ode, 0.0),
    }
    rows = []
    for name, (params, explicit, eta) in cases.items():
        kernel = registry.create("kernel", name, **params)
        x_next = kernel.step(v, x, sigmas, i, generator=g).prev_sample
        ours = kernel.step(v, x, sigmas, i, prev_sample=x_next)
        mean, lp = explicit(v, x, sigmas, i, x_next, eta)
        d_mean = float((ours.mean - mean).abs().max())
        d_lp = float((ours.log_prob - lp).abs().max())
        a, b = [], []
        for _ in range(args.repeats):  # interleaved
            a += timed(lambda kernel=kernel, x_next=x_next: kernel.step(v, x, sigmas, i, prev_sample=x_next), 1)
            b += timed(lambda explicit=explicit, x_next=x_next, eta=eta: explicit(v, x, sigmas, i, x_next, eta), 1)
        rows.append(
            [
                name,
                f"{d_mean:.2g}",
                f"{d_lp:.2g}",
                f"{_bench.median(a) * 1e6:.0f}",
                f"{_bench.median(b) * 1e6:.0f}",
                f"{_bench.paired_ratio(a, b):.2f}",
            ]
        )

    rows.append(dpmpp2m_row(x, v, sigmas, args.repeats))
    print(
        f"kernels on a batch of {args.batch} x {tuple(args.shape)}, {args.steps}-step shifted schedule, step {i}; "
        f"{_bench.machine_line()}"
    )
    print(
        _bench.table(["kernel", "max |d mean|", "max |d log-prob|", "fgrpo us", "explicit us", "fgrpo/explicit"], rows)
    )
    return 0


def dpmpp2m_row(x, v, sigmas, repeats) -> list[str]:
    """Two DPM-Solver++(2M) steps against diffusers' scheduler (velocity turned into its x0)."""

    from fgrpo.core import registry

    try:
        from diffusers import DPMSolverMultistepScheduler
    except ImportError:
        return ["dpmpp2m", "n/a", "n/a", "n/a", "n/a", "diffusers not installed"]
    kernel = registry.create("kernel", "dpmpp2m")
    steps = len(sigmas) - 1

    def ours():
        kernel.reset()
        y = kernel.step(v, x, sigmas, 0).prev_sample
        return kernel.step(v, y, sigmas, 1).prev_sample

    scheduler = DPMSolverMultistepScheduler(
        algorithm_type="dpmsolver++",
        solver_order=2,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        final_sigmas_type="zero",
        lower_order_final=True,
    )

    def explicit():
        scheduler.set_timesteps(steps)
        scheduler.sigmas = sigmas.clone()
        scheduler.timesteps = sigmas[:-1] * 1000
        y = x
        for k in range(2):
            y = scheduler.step(v, scheduler.timesteps[k], y).prev_sample
        return y

    try:
        diff = float((ours() - explicit()).abs().max())
    except Exception as exc:  # the scheduler's API moves between diffusers versions
        return ["dpmpp2m", "n/a", "n/a", "n/a", "n/a", f"diffusers: {type(exc).__name__}"]
    a, b = [], []
    for _ in range(max(1, repeats // 4)):
        a += timed(ours, 1)
        b += timed(explicit, 1)
    return [
        "dpmpp2m (2 steps)",
        f"{diff:.2g}",
        "-",
        f"{_bench.median(a) * 1e6:.0f}",
        f"{_bench.median(b) * 1e6:.0f}",
        f"{_bench.paired_ratio(a, b):.2f}",
    ]


if __name__ == "__main__":
    sys.exit(main())
