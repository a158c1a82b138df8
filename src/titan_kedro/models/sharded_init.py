"""Initialisation on shards: each rank fills only its own part, the same global values.

The trainer builds a model on the meta device, cuts its pipeline stages and applies TP,
EP and FSDP there, then allocates each rank's shards (``to_empty``) and calls the
model's ``init_weights()`` inside :func:`keyed_init`. The random initialisers of this
module (:func:`normal_`, :func:`trunc_normal_`) then draw a parameter's values from its
*name and global position*, not from a stream shared by the whole model:

- a parameter of global shape ``[n0, ...]`` is cut along dim 0 into fixed chunks of
  ``rows_per_chunk(shape)`` rows (about ``CHUNK_ELEMENTS`` values each; the cut depends
  on the global shape only);
- chunk ``c`` is drawn on the CPU by a generator seeded with
  ``blake2b(f"{seed}/{name}/{c}")``;
- a rank draws the chunks that overlap its shard's rows (``DTensor``: the box
  ``compute_local_shape_and_global_offset`` gives) and copies its slice in.

So a one-process model and every layout (FSDP, HSDP, TP, EP, PP, any mix) start from
bitwise the same global tensors, whatever the rank's share; drawing on the CPU also makes
a GPU run's weights equal a CPU reference's. Constant initialisers (:func:`ones_`,
:func:`zeros_`) fill the local shard.

Names are the parameters' names in the unsplit model (wrappers' ``_checkpoint_wrapped_module.``
and ``_orig_mod.`` segments dropped): pipeline stages keep them, so a stage draws what the
whole model would.

Outside :func:`keyed_init` (a model built directly, e.g. on one device in a test) the
initialisers fall back to ``torch.nn.init`` and the global RNG.

**A custom model** takes part by writing ``init_weights(self)`` with these initialisers
(``titan_kedro.models.sharded_init.normal_`` …) for every parameter. A model whose
``init_weights`` leaves a sharded parameter to anything else (``torch.nn.init`` would draw
different values on every rank) is refused by :func:`init_on_shards`, naming the
parameters and the method to write.
"""

from __future__ import annotations

import contextvars
import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

CHUNK_ELEMENTS = 1 << 16
"""About how many values one seeded draw makes (whole rows of dim 0, at least one row)."""

_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


class ShardedInitError(TypeError):
    """A model's ``init_weights`` cannot initialise its parameters on shards."""


@dataclass
class _Keys:
    seed: int
    names: dict[int, str]
    """``id(parameter)`` → its name in the unsplit model."""
    touched: set[int] = field(default_factory=set)


_ACTIVE: contextvars.ContextVar[_Keys | None] = contextvars.ContextVar("sharded_init", default=None)


def clean_name(name: str) -> str:
    """``name`` without the wrappers' segments (the name ``state_dict`` shows)."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


@contextmanager
def keyed_init(model: nn.Module, seed: int) -> Iterator[_Keys]:
    """Inside, this module's initialisers draw ``model``'s parameters by name and position."""
    names = {id(p): clean_name(n) for n, p in model.named_parameters(remove_duplicate=False)}
    keys = _Keys(seed, names)
    token = _ACTIVE.set(keys)
    try:
        with torch.no_grad():
            yield keys
    finally:
        _ACTIVE.reset(token)


def rows_per_chunk(shape: torch.Size | tuple[int, ...]) -> int:
    """Rows of dim 0 that one seeded draw covers (set by the global shape alone)."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, CHUNK_ELEMENTS // max(row, 1))


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """``(local tensor, its global offset, the global shape)``."""
    if isinstance(tensor, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        local = tensor.to_local()
        if tuple(local.shape) != tuple(shape):  # never for FSDP2 or the TP/EP plans
            raise ShardedInitError(f"a DTensor's local shape {tuple(local.shape)} is not {shape}")
        return local, tuple(offset), tuple(tensor.shape)
    return tensor, (0,) * tensor.ndim, tuple(tensor.shape)


def _draw(tensor: torch.Tensor, fill: object) -> None:
    """Fill ``tensor``'s local values chunk by chunk with ``fill(chunk, generator)``."""
    keys = _ACTIVE.get()
    name = keys.names.get(id(tensor)) if keys is not None else None
    if name is None:
        raise ShardedInitError("not a parameter of the model being initialised")
    keys.touched.add(id(tensor))
    local, offset, shape = _local_box(tensor)
    if local.numel() == 0:
        return
    if not shape:  # a scalar parameter: one draw
        value = torch.empty((), dtype=torch.float32)
        fill(value, torch.Generator().manual_seed(_chunk_seed(keys.seed, name, 0)))  # type: ignore[operator]
        local.copy_(value)
        return
    rows = rows_per_chunk(shape)
    start, stop = offset[0], offset[0] + local.shape[0]
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:], strict=True))
    for chunk in range(start // rows, (stop - 1) // rows + 1):
        lo, hi = chunk * rows, min((chunk + 1) * rows, shape[0])
        values = torch.empty((hi - lo, *shape[1:]), dtype=torch.float32)
        fill(values, torch.Generator().manual_seed(_chunk_seed(keys.seed, name, chunk)))  # type: ignore[operator]
        a, b = max(lo, start), min(hi, stop)
        local[a - start : b - start].copy_(values[(slice(a - lo, b - lo), *inner)])


def _keyed(tensor: torch.Tensor) -> bool:
    keys = _ACTIVE.get()
    return keys is not None and id(tensor) in keys.names


def normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """``torch.nn.init.normal_``, drawn by name and position inside :func:`keyed_init`."""
    if not _keyed(tensor):
        return nn.init.normal_(tensor, mean=mean, std=std)
    _draw(tensor, lambda t, g: t.normal_(mean, std, generator=g))
    return tensor


def trunc_normal_(
    tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0
) -> torch.Tensor:
    """``torch.nn.init.trunc_normal_``, drawn by name and position inside :func:`keyed_init`."""
    if not _keyed(tensor):
        return nn.init.trunc_normal_(tensor, mean=mean, std=std, a=a, b=b)
    _draw(tensor, lambda t, g: nn.init.trunc_normal_(t, mean, std, a, b, generator=g))
    return tensor


def _constant(tensor: torch.Tensor, value: float) -> torch.Tensor:
    keys = _ACTIVE.get()
    if keys is not None:
        keys.touched.add(id(tensor))
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    with torch.no_grad():
        local.fill_(value)
    return tensor


def ones_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill with ones (the local shard of a ``DTensor``)."""
    return _constant(tensor, 1.0)


def zeros_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill with zeros (the local shard of a ``DTensor``)."""
    return _constant(tensor, 0.0)


def init_on_shards(model: nn.Module, seed: int, device: torch.device | str) -> nn.Module:
    """Allocate ``model``'s parameters (each rank its shards) on ``device`` and initialise them.

    ``model`` is on the meta device, already cut into its stage and parallelized. Its
    ``init_weights()`` runs inside :func:`keyed_init`.

    Raises:
        ShardedInitError: The model has no ``init_weights``, or it left parameters to
            anything but this module's initialisers (named, with the method to write).
    """
    init = getattr(model, "init_weights", None)
    if init is None:
        raise ShardedInitError(
            f"{type(model).__name__} has no init_weights(): write one that initialises every "
            "parameter with titan_kedro.models.sharded_init's normal_ / trunc_normal_ / ones_ "
            "/ zeros_ (docs/ARCHITECTURE.md, Initialisation on shards)"
        )
    model.to_empty(device=device)
    with keyed_init(model, seed) as keys:
        init()
    missed = [clean_name(n) for n, p in model.named_parameters() if id(p) not in keys.touched]
    if missed:
        shown = ", ".join(missed[:5]) + (f" and {len(missed) - 5} more" if len(missed) > 5 else "")
        raise ShardedInitError(
            f"{type(model).__name__}.init_weights() left {shown} to another initialiser. Each "
            "rank holds only its shard, so torch.nn.init would draw different values on every "
            "rank: write init_weights(self) with titan_kedro.models.sharded_init's normal_ / "
            "trunc_normal_ / ones_ / zeros_ for every parameter (docs/ARCHITECTURE.md, "
            "Initialisation on shards)"
        )
    return model
