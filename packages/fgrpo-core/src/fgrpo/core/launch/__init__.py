"""Launch kinds: everything that differs between one process, data parallel, FSDP2 and DeepSpeed
ZeRO-2/ZeRO-3 (with or without CPU offloading), behind one object per run (``run.learner.launch``, a
:class:`Launch`) that the update, the checkpoints and evaluation call, so that none of them
branches on the kind.

- :mod:`.protocol`: what every kind does (backward, the optimizer step, padding passes, gathering
  and loading state for checkpoints, the main process, sharing a value);
- :mod:`.processes` (data parallel, one process or several), :mod:`.fsdp`, :mod:`.deepspeed`: one
  class per kind, with its set-up;
- :mod:`.start`: the run's Accelerator and the class that serves it (:func:`start`, :func:`of`);
- :mod:`.shards`: whole tensors, DTensor shards and ZeRO-3 partitions, for whoever writes or reads state.

A new kind is one class satisfying :class:`Launch` (and its set-up), named in
:data:`.start.SHARDED` or chosen by :func:`.start.launch_class`.
"""

from fgrpo.core.launch.processes import DataParallel
from fgrpo.core.launch.protocol import Launch
from fgrpo.core.launch.shards import full, full_state, is_partitioned, is_sharded_tensor, local, shard_like
from fgrpo.core.launch.start import (
    accelerate_settings,
    kind,
    loads_shards,
    make_accelerator,
    of,
    start,
)

__all__ = [
    "DataParallel",
    "Launch",
    "accelerate_settings",
    "full",
    "full_state",
    "is_partitioned",
    "is_sharded_tensor",
    "kind",
    "loads_shards",
    "local",
    "make_accelerator",
    "of",
    "shard_like",
    "start",
]
