"""Under torchrun: a tiny SD3 (SD3.5-style, with a dual-attention layer) and a tiny Wan transformer,
forward and backward with model.context_parallel's Ulysses split over the processes against the
same transformer whole in each process (a copy made before the split): the output on every
process and the weight gradients summed over the group. Usage: cp_transformer_worker.py OUT.json"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

from fgrpo.models import context_parallel
from fgrpo.models.testing import build_tiny_sd3_pipeline
from fgrpo.models.testing.pipelines.wan import _wan_transformer


def inputs(backbone: str) -> tuple[torch.nn.Module, dict]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the tiny Wan draws its weights from the global RNG: the same on every process
    if backbone == "sd3":
        # 4 x 5 = 20 image tokens and 7 text tokens: blocks of unequal size on 2 processes
        return build_tiny_sd3_pipeline(sd35=True).transformer, {
            "hidden_states": torch.randn(2, 16, 8, 10, generator=g),
            "encoder_hidden_states": torch.randn(2, 7, 64, generator=g),
            "pooled_projections": torch.randn(2, 64, generator=g),
            "timestep": torch.tensor([500.0, 300.0]),
        }
    return _wan_transformer(), {
        "hidden_states": torch.randn(2, 16, 3, 6, 4, generator=g),  # 3 x 3 x 2 = 18 tokens
        "encoder_hidden_states": torch.randn(2, 5, 32, generator=g),
        "timestep": torch.tensor([500.0, 300.0]),
    }


def forward_backward(transformer: torch.nn.Module, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    out = transformer(**kw, return_dict=False)[0]
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)  # a loss that weighs every output differently
    (out * weights).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in transformer.parameters() if p.grad is not None])
    return out.detach(), grads


def main() -> None:
    dist.init_process_group("gloo")
    report = {}
    for backbone in ("sd3", "wan"):
        transformer, kw = inputs(backbone)
        whole = copy.deepcopy(transformer)
        context_parallel.enable([transformer], {"ulysses_degree": dist.get_world_size(), "ring_degree": 1})
        out, grads = forward_backward(transformer, kw)
        dist.all_reduce(grads)  # each process's gradient is its tokens' part
        ref_out, ref_grads = forward_backward(whole, kw)
        report[backbone] = {
            "output": float((out - ref_out).abs().max()),
            "gradients": float((grads - ref_grads).abs().max()),
            "largest_gradient": float(ref_grads.abs().max()),
        }
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(report, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
