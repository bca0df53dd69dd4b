"""Reading published reward weights safely: a local file or a file of a hub repository.

A weights spec is a local path, or ``owner/repo:filename`` for a file of a hub repository
(fetched by huggingface_hub, which honours HF_HUB_OFFLINE and HF_HOME). ``.safetensors`` files are
read with safetensors; pickled checkpoints (``.pt``, ``.pth``, ``.bin``) only with
``torch.load(weights_only=True)``, so a checkpoint cannot run code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


def resolve_file(spec: str, key: str) -> Path:
    """The local path of a weights spec (downloading ``owner/repo:filename`` on first use)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if ":" in spec and not path.exists():
        repo, filename = spec.split(":", 1)
        try:
            from huggingface_hub import hf_hub_download

            return Path(hf_hub_download(repo_id=repo, filename=filename))
        except Exception as exc:  # offline, unknown repo or file: one clear line
            raise OSError(f"{key}: cannot fetch {filename!r} from the hub repository {repo!r}: {exc}") from exc
    raise OSError(f"{key}: {spec!r} is not a file; expected a local file or owner/repo:filename")


def read_state_dict(spec: str, key: str) -> dict[str, torch.Tensor]:
    """The tensors of a weights file; a checkpoint that wraps them in ``state_dict`` or ``model``
    is unwrapped, and a ``module.`` prefix (DataParallel) is dropped."""
    path = resolve_file(spec, key)
    state: Any  # a mapping of tensors, perhaps wrapped: checked below
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise OSError(f"{key}: cannot read weights from {str(path)!r}: {exc}") from exc
    for wrapper in ("state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(wrapper), Mapping):
            state = state[wrapper]
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise OSError(f"{key}: {str(path)!r} holds no mapping of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}
