"""Healing transfer: a live group sends its state to a restarted one over the replica PG.

A TorchFT :class:`~torchft.checkpointing.CheckpointTransport` whose wire format holds no
pickle: a JSON header (the step, the pytree structure from ``treespec_dumps``, each
leaf's path and, for tensors, shape and dtype; plain values inline) followed by every
tensor's bytes, sent with point-to-point ops on the cross-group process group. The
receiver checks the header against what it expects and receives into its own state's
tensors in place where path, shape and dtype match (so a ``DTensor`` shard keeps its
placement), else into new tensors; nothing it receives is ever executed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import (
    keystr,
    tree_flatten_with_path,
    tree_unflatten,
    treespec_dumps,
    treespec_loads,
)
from torchft.checkpointing import CheckpointTransport

logger = logging.getLogger(__name__)

HEADER_LEN_TAG = 1
HEADER_TAG = 2
FIRST_TENSOR_TAG = 3
JSON_SCALARS = (bool, int, float, str, type(None))


class HealTransferError(RuntimeError):
    """The state sent by a live group does not fit the receiving group's state."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_header(state: Any, step: int) -> tuple[bytes, list[torch.Tensor]]:
    """The JSON header and the tensors (local shards, contiguous) of ``state``.

    Raises:
        TypeError: A leaf is neither a tensor nor a JSON scalar (named by its path).
    """
    leaves, spec = tree_flatten_with_path(state)
    entries: list[dict[str, Any]] = []
    tensors: list[torch.Tensor] = []
    for path, value in leaves:
        name = keystr(path)
        if isinstance(value, torch.Tensor):
            local = _local(value).detach().contiguous()
            entries.append(
                {"path": name, "shape": list(local.shape), "dtype": _dtype_name(local.dtype)}
            )
            tensors.append(local)
        elif isinstance(value, JSON_SCALARS):
            entries.append({"path": name, "value": value})
        else:
            raise TypeError(
                f"healing state leaf {name} is a {type(value).__name__}; only tensors and "
                "JSON scalars travel between replica groups"
            )
    header = {"step": step, "treespec": treespec_dumps(spec), "leaves": entries}
    return json.dumps(header).encode("utf-8"), tensors


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view sharing ``tensor``'s (contiguous) storage."""
    return tensor.reshape(-1).view(torch.uint8)


class JsonPGTransport(CheckpointTransport[Any]):
    """Send and receive a state dict between replica groups without pickle.

    Args:
        pg: The cross-group process group (the TorchFT manager's).
        device: Where tensors travel (``cpu`` for gloo, the GPU for NCCL).
        state_dict: This group's current state, whose tensors receive in place.
    """

    def __init__(
        self, pg: Any, device: torch.device, state_dict: Callable[[], Any] | None = None
    ) -> None:
        self._pg = pg
        self._device = device
        self._state_dict = state_dict

    def metadata(self) -> str:
        return "json-pg"

    def disallow_checkpoint(self) -> None:
        """Nothing to close: the state is read while the quorum holds the training loop."""

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        """Send ``state_dict`` at ``step`` to every replica rank in ``dst_ranks``."""
        header, tensors = encode_header(state_dict, step)
        payload = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self._device)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=self._device)
        for dst in dst_ranks:
            self._pg.send([length], dst, tag=HEADER_LEN_TAG).wait(timeout)
            self._pg.send([payload], dst, tag=HEADER_TAG).wait(timeout)
        for index, tensor in enumerate(tensors):
            if not tensor.numel():
                continue
            data = _as_bytes(tensor.to(self._device))
            for dst in dst_ranks:
                self._pg.send([data], dst, tag=FIRST_TENSOR_TAG + index).wait(timeout)
        logger.info(
            "sent step-%d state (%d tensors) to replica ranks %s", step, len(tensors), dst_ranks
        )

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """Receive the state a live group sends for ``step``.

        Raises:
            HealTransferError: The header's step or structure is not what this group expects.
        """
        length = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._pg.recv([length], src_rank, tag=HEADER_LEN_TAG).wait(timeout)
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self._device)
        self._pg.recv([payload], src_rank, tag=HEADER_TAG).wait(timeout)
        header = json.loads(bytes(payload.cpu().numpy()).decode("utf-8"))
        if header["step"] != step:
            raise HealTransferError(
                f"replica rank {src_rank} sent step {header['step']}, not {step}"
            )
        own = self._state_dict() if self._state_dict is not None else {}
        targets = {keystr(path): value for path, value in tree_flatten_with_path(own)[0]}
        values: list[Any] = []
        tag = FIRST_TENSOR_TAG
        for entry in header["leaves"]:
            if "value" in entry:
                values.append(entry["value"])
                continue
            values.append(
                self._recv_tensor(entry, targets.get(entry["path"]), src_rank, tag, timeout)
            )
            tag += 1
        return tree_unflatten(values, treespec_loads(header["treespec"]))

    def _recv_tensor(
        self, entry: dict[str, Any], target: Any, src_rank: int, tag: int, timeout: timedelta
    ) -> torch.Tensor:
        dtype = getattr(torch, entry["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise HealTransferError(f"{entry['path']}: unknown dtype {entry['dtype']!r}")
        shape = tuple(entry["shape"])
        local = _local(target) if isinstance(target, torch.Tensor) else None
        in_place = (
            local is not None
            and tuple(local.shape) == shape
            and local.dtype == dtype
            and local.is_contiguous()
            and local.device.type == self._device.type
        )
        if isinstance(target, DTensor) and not in_place:
            raise HealTransferError(
                f"{entry['path']}: the sender's shard {shape} {entry['dtype']} does not match this "
                f"group's {tuple(local.shape)} {local.dtype}; every replica group must run the same "
                "launch.nproc_per_node and parallelism settings"
            )
        buffer = local if in_place else torch.empty(shape, dtype=dtype, device=self._device)
        if buffer.numel():
            self._pg.recv([_as_bytes(buffer)], src_rank, tag=tag).wait(timeout)
        if in_place:
            return target.detach() if isinstance(target, DTensor) else local
        return buffer.cpu() if self._device.type != "cpu" else buffer

    def shutdown(self, wait: bool = True) -> None:
        """No threads or servers to stop."""
