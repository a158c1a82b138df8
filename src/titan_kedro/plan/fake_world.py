"""A fake process group of any world size in this process (torch's ``fake`` backend)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Be rank ``rank`` of ``world_size`` ranks whose collectives do nothing.

    Meshes, FSDP2 and DTensor placements behave as in a real job, so sharded shapes can
    be read. The group is destroyed on exit, so nothing else in the process sees it.

    Raises:
        RuntimeError: A (real) default process group already exists in this process.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "cannot plan inside a process that already has a process group; build the plan "
            "before torch.distributed.init_process_group (e.g. in the Kedro process)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
