"""A small network trained in full or through LoRA, with its reference (the base) at hand.

What the small policies (``vector``, ``trajectory``) share: full fine-tuning keeps a frozen copy of the base
for ``reference()`` (the network is small); ``lora`` injects peft adapters (B = 0 at the start,
so the adapted network starts exactly at the base) and ``reference()`` disables them.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from fgrpo.models.lora import lora_config

Net = TypeVar("Net", bound=nn.Module)


class SmallNet(Generic[Net]):
    """``network`` (frozen on entry) made trainable: every weight (``lora`` None) or a LoRA adapter."""

    def __init__(self, network: Net, lora: Mapping[str, Any] | None, *, seed: int, device: torch.device | str):
        self.trained = network
        self._reference: Net | None = None
        self._adapters: list[Any] = []
        self._depth = 0
        if lora is None:
            self._reference = copy.deepcopy(network)
            network.requires_grad_(True)
        else:
            try:
                from peft import inject_adapter_in_model
                from peft.tuners.tuners_utils import BaseTunerLayer
            except ImportError as exc:  # peft ships with the [diffusers] extra
                raise ImportError(
                    'model.lora needs peft: pip install "fgrpo-models[diffusers]" (or pip install peft)'
                ) from exc
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                inject_adapter_in_model(lora_config(lora), network)
            network.to(device)
            for name, p in network.named_parameters():
                p.requires_grad_("lora_" in name)
            self._adapters = [m for m in network.modules() if isinstance(m, BaseTunerLayer)]
        self._trainable = {n: p for n, p in network.named_parameters() if p.requires_grad}

    def to(self, device: torch.device | str) -> None:
        self.trained.to(device)
        if self._reference is not None:
            self._reference.to(device)

    def module(self) -> Net:
        """The network ``velocity`` calls now (the frozen base inside :meth:`reference`)."""
        return self._reference if (self._depth and self._reference is not None) else self.trained

    def parameters(self) -> list[nn.Parameter]:
        return list(self._trainable.values())

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        outermost = self._depth == 0
        self._depth += 1
        if outermost:
            for layer in self._adapters:
                layer.enable_adapters(False)
        try:
            yield
        finally:
            self._depth -= 1
            if outermost:
                for layer in self._adapters:
                    layer.enable_adapters(True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the trained tensors (the adapter's, or every weight)."""
        return {name: p.detach().to("cpu").clone() for name, p in self._trainable.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], what: str) -> None:
        missing = sorted(set(self._trainable) - set(state))
        unexpected = sorted(set(state) - set(self._trainable))
        if missing or unexpected:
            raise ValueError(
                f"trainable state does not fit {what}: missing {missing[:4] or 'none'}, unexpected "
                f"{unexpected[:4] or 'none'}"
            )
        with torch.no_grad():
            for name, p in self._trainable.items():
                value = state[name]
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(
                        f"trainable state {name!r} has shape {tuple(value.shape)}, the policy has {tuple(p.shape)}"
                    )
                p.copy_(value.to(device=p.device, dtype=p.dtype))

    def base(self) -> Net:
        """The base network (a copy with the adapters left out, or the frozen copy)."""
        if self._reference is not None:
            return self._reference
        return self.merged(copy.deepcopy, keep_adapter=False)

    def merged(self, clone: Callable[[Net], Net], keep_adapter: bool = True) -> Net:
        """A plain network (no peft layers) computing what :meth:`module` computes now (the adapter
        merged into the weights; ``keep_adapter`` False: the base)."""
        out = clone(self.trained)
        if not self._adapters:
            return out
        from peft.tuners.tuners_utils import BaseTunerLayer

        for name, layer in list(out.named_modules()):
            if isinstance(layer, BaseTunerLayer):
                if keep_adapter:
                    layer.merge()
                parent = out.get_submodule(name.rsplit(".", 1)[0]) if "." in name else out
                setattr(parent, name.rsplit(".", 1)[-1], layer.get_base_layer())
        return out
