"""Pretrain the ``trajectory`` planner's shipped base by behaviour cloning on the driving world's
teacher logs, and write ``packages/fgrpo-worlds/src/fgrpo/worlds/driving/weights/driving-base.safetensors``.

Data: the flawed IDM+MOBIL teacher drives ``--seeds`` scenarios of every type (seeds 0 .. n - 1;
held-out seeds start at 1,000,000) among reactive traffic; every 0.5 s from 0 to ``--until`` s
of each log gives one (scene encoding, the teacher's next 4 s) pair. Training: rectified-flow
matching of the normalised plans (the model's own space), sigma uniform, AdamW with a cosine
decay, batch ``--batch``, ``--steps`` steps, one thread. The file's metadata records how it was
made. Measured on 2 shared cores: see the README's planner section.

    python -m fgrpo.worlds.driving.pretrain                  # the shipped base
    python -m fgrpo.worlds.driving.pretrain --steps 200 --seeds 20 --out /tmp/tiny.safetensors
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from fgrpo.worlds.driving import features, scenes
from fgrpo.worlds.driving.planner import Architecture, PlanVelocity, from_waypoints, save_network
from fgrpo.worlds.driving.world import HORIZON_STEPS, PLAN_DT, TYPES

DEFAULT_OUT = Path(__file__).resolve().parent / "weights" / "driving-base.safetensors"  # the shipped base


def dataset(seeds: int, until: float, chunk: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """(features (N, 38), plans (N, T, 2) in metres) from the teacher's logs."""
    keys = [(k, s) for k in range(len(TYPES)) for s in range(seeds)]
    xs, ys = [], []
    snapshots = int(round(until / PLAN_DT)) + 1
    for start in range(0, len(keys), chunk):
        part = keys[start : start + chunk]
        scenes.teacher_logs(part, until)
        for key in part:
            log = scenes._LOGS[key]
            xs.append(features.encode(log.scenes.index(slice(0, snapshots))))
            plans = torch.stack([log.positions[k + 1 : k + 1 + HORIZON_STEPS] for k in range(snapshots)])
            from fgrpo.worlds.driving.sim import world_to_frame

            ys.append(world_to_frame(plans, log.scenes.ego[:snapshots]))
            del scenes._LOGS[key]  # keep the memory flat
    return torch.cat(xs), torch.cat(ys)


def train(
    cond: torch.Tensor, plans: torch.Tensor, arch: Architecture, steps: int, batch: int, lr: float, seed: int
) -> tuple[PlanVelocity, list[float]]:
    torch.manual_seed(seed)
    net = PlanVelocity(arch)
    z = from_waypoints(plans, arch)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min(1.0, (i + 1) / 200) * 0.5 * (1 + math.cos(math.pi * i / steps))
    )
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    for i in range(steps):
        rows = torch.randint(0, len(z), (batch,), generator=g)
        x0, c = z[rows], cond[rows]
        eps = torch.randn(x0.shape, generator=g)
        sigma = torch.rand(batch, generator=g)
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * eps
        loss = (net(xt, sigma, c) - (eps - x0)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (i + 1) % max(1, steps // 10) == 0:
            print(f"step {i + 1}/{steps}: loss {sum(losses[-100:]) / len(losses[-100:]):.4f}", flush=True)
    return net, losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=600, help="teacher scenarios per type")
    parser.add_argument("--until", type=float, default=10.0, help="latest log time of a training scene [s]")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=112)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    cond, plans = dataset(args.seeds, args.until)
    t1 = time.perf_counter()
    print(
        f"{len(cond)} (scene, plan) pairs from {args.seeds * len(TYPES)} teacher logs in {t1 - t0:.1f} s", flush=True
    )
    arch = Architecture(cond_dim=features.SIZE, hidden=args.hidden, blocks=args.blocks)
    net, losses = train(cond, plans, arch, args.steps, args.batch, args.lr, args.seed)
    t2 = time.perf_counter()
    params = sum(p.numel() for p in net.parameters())
    made = {
        "seeds_per_type": args.seeds,
        "until": args.until,
        "pairs": len(cond),
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "seed": args.seed,
        "final_loss": round(sum(losses[-100:]) / len(losses[-100:]), 5),
        "data_seconds": round(t1 - t0, 1),
        "train_seconds": round(t2 - t1, 1),
        "parameters": params,
    }
    save_network(net, args.out, extra={"trained": json.dumps(made, sort_keys=True)})
    print(f"wrote {args.out} ({params} parameters; data {t1 - t0:.0f} s, training {t2 - t1:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
