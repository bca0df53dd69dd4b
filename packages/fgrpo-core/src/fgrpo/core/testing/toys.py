"""A public toy policy for tests of samplers, objectives, the trainer and conformance bases.

:class:`GaussianPolicy` is the exact velocity of a Gaussian data distribution: data x0 ~ N(m(c),
s^2 I), the mean m(c) set by the prompt (a fixed random vector per prompt, times a trainable
scalar ``gain``). With x = (1 - sigma) x0 + sigma eps the posterior means are closed form, and
v(x, sigma, c) = E[eps - x0 | x]. Everything is elementwise per row, so a row's velocity does
not depend on the batch it is evaluated in (the samplers' shared-prefix tests rely on that).
``guidance`` turns on classifier-free guidance (unconditional mean 0), which costs 2
evaluations per call. ``rows`` lists the batch size of every ``velocity`` call and ``encoded``
every prompt encoded. ``reference()`` is the base model (gain 1).

It needs nothing but torch::

    from fgrpo.core.testing import GaussianPolicy

    policy = GaussianPolicy(shape=(2, 4, 4), guidance=4.5)
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator, Mapping, Sequence

import torch

from fgrpo.core import flow


class GaussianPolicy:
    """The exact velocity of a prompt-conditioned Gaussian (see the module docstring)."""

    def __init__(self, shape: Sequence[int] = (4,), spread: float = 0.5, guidance: float | None = None):
        self.device = torch.device("cpu")
        self.shape = tuple(shape)
        self.spread = float(spread)
        self.guidance = guidance
        self.evaluations_per_call = 1 if guidance is None else 2
        self.gain = torch.nn.Parameter(torch.ones(()))
        self.rows: list[int] = []
        self.encoded: list[str] = []
        self._reference_depth = 0

    def _prompt_mean(self, prompt: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
        return 2 * torch.randn(self.shape, generator=g)

    def encode(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        self.encoded.extend(prompts)
        means = torch.stack([self._prompt_mean(p) for p in prompts])
        return {"mean": means, "length": torch.tensor([len(p) for p in prompts])}

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn((n, *self.shape), generator=generator)

    def sigmas(self, steps: int) -> torch.Tensor:
        return flow.shifted_sigmas(steps, 3.0)

    def _velocity(self, x: torch.Tensor, sigma: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        sig = sigma.reshape(-1, *([1] * (x.dim() - 1))).to(x.dtype)
        alpha = 1 - sig
        s2 = self.spread**2
        var = alpha * alpha * s2 + sig * sig
        resid = x - alpha * mean
        eps = sig * resid / var
        x0 = mean + alpha * s2 * resid / var
        return eps - x0

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        assert sigma.shape == (x.shape[0],), "sigma must be (batch,)"
        assert cond["mean"].shape[0] == x.shape[0], "conditioning must be batched like x"
        self.rows.append(int(x.shape[0]))
        gain = torch.ones(()) if self._reference_depth else self.gain
        v = self._velocity(x, sigma, cond["mean"] * gain)
        if self.guidance is not None:
            v_uncond = self._velocity(x, sigma, torch.zeros_like(cond["mean"]))
            v = v_uncond + self.guidance * (v - v_uncond)
        return v

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def trainable_parameters(self) -> Iterator[torch.nn.Parameter]:
        yield self.gain

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        self._reference_depth += 1  # nested contexts keep the reference until the outermost exit
        try:
            yield
        finally:
            self._reference_depth -= 1

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {"gain": self.gain.detach().clone()}

    def load_trainable_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if set(state) != {"gain"}:
            raise ValueError(f"trainable state: expected the key 'gain', got {sorted(state)}")
        with torch.no_grad():
            self.gain.copy_(state["gain"])


class SyntheticImage:
    """An in-memory source image for tests of editing backbones and rewards: a smooth random RGB
    image of ``width`` x ``height`` drawn from ``seed``; hashable and picklable, an image
    reference :func:`fgrpo.core.media.load_image` opens (``to_pil``)."""

    def __init__(self, seed: int, width: int = 32, height: int = 32):
        self.key = (int(seed), int(width), int(height))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SyntheticImage) and other.key == self.key

    def __hash__(self) -> int:
        return hash(("SyntheticImage", self.key))

    def __repr__(self) -> str:
        return f"SyntheticImage{self.key}"

    def __reduce__(self) -> tuple:
        return (SyntheticImage, self.key)

    def to_pil(self):
        import numpy as np
        from PIL import Image

        seed, width, height = self.key
        coarse = torch.rand(1, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
        smooth = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)[0]
        return Image.fromarray(np.ascontiguousarray((smooth.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)))


__all__ = ["GaussianPolicy", "SyntheticImage"]
