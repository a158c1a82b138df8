"""Start a fresh run from a Hugging Face folder (continued pretraining).

``checkpoint.initial_load_hf`` names a folder with ``config.json`` and safetensors weights
(one ``model.safetensors`` or shards with ``model.safetensors.index.json``). The folder's
config must describe the configured model (``check_hf_config``); the spec's
``state_dict_adapter.from_hf`` maps the names. Every rank reads only the part of each
tensor that its FSDP / expert-parallel shard holds: the adapter runs over lazy tensor
handles, and each local chunk is read with ``safe_open(...).get_slice(name)[...]``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from titan_kedro.models.hf_export import SAFETENSORS_FILE, SAFETENSORS_INDEX
from titan_kedro.storage import is_remote
from titan_kedro.storage.folders import download_folder

log = logging.getLogger(__name__)

# Args that do not change the weights: the rotary table length, the init scale and the
# auxiliary-loss settings may differ from the folder's.
_IGNORED_ARGS = frozenset({"max_seq_len", "initializer_range", "aux_loss_alpha", "seq_aux"})
Index = tuple[slice, ...]


class HFInitError(ValueError):
    """The Hugging Face folder does not fit the configured model (the message says how)."""


class _Lazy:
    """A tensor not read yet: ``shape`` is known, ``read(index)`` returns that block."""

    shape: torch.Size
    device = torch.device("cpu")

    def read(self, index: Index) -> torch.Tensor:
        raise NotImplementedError

    def chunk(self, chunks: int, dim: int = 0) -> list[_Lazy]:
        size = -(-self.shape[dim] // chunks)
        return [
            _Narrow(self, dim, start, min(size, self.shape[dim] - start))
            for start in range(0, self.shape[dim], size)
        ]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.stack and kwargs.get("dim", args[1] if len(args) > 1 else 0) == 0:
            return _Stack(list(args[0]))
        raise TypeError(f"a state_dict_adapter applied {func} to a lazily read tensor")


class _Source(_Lazy):
    """One tensor of a safetensors file; ``read_bytes`` counts what was read of it."""

    def __init__(self, handle: Any, name: str):
        self.handle, self.name = handle, name
        self.shape = torch.Size(handle.get_slice(name).get_shape())
        self.read_bytes = 0

    def read(self, index: Index) -> torch.Tensor:
        block = self.handle.get_slice(self.name)[index]
        self.read_bytes += block.numel() * block.element_size()
        return block


class _Narrow(_Lazy):
    def __init__(self, base: _Lazy, dim: int, start: int, length: int):
        self.base, self.dim, self.start = base, dim, start
        shape = list(base.shape)
        shape[dim] = length
        self.shape = torch.Size(shape)

    def read(self, index: Index) -> torch.Tensor:
        index = list(index)
        part = index[self.dim]
        index[self.dim] = slice(part.start + self.start, part.stop + self.start)
        return self.base.read(tuple(index))


class _Stack(_Lazy):
    def __init__(self, parts: list[_Lazy]):
        self.parts = parts
        self.shape = torch.Size([len(parts), *parts[0].shape])

    def read(self, index: Index) -> torch.Tensor:
        rows = range(index[0].start, index[0].stop)
        return torch.stack([self.parts[i].read(index[1:]) for i in rows])


def _read(value: Any, index: Index) -> torch.Tensor:
    if isinstance(value, _Lazy):
        return value.read(index)
    return value[index]


def _weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files; names from the index must lie in the folder."""
    index_file = folder / SAFETENSORS_INDEX
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if Path(n).name != n or not n.endswith(".safetensors")]
        if outside:
            raise HFInitError(
                f"checkpoint.initial_load_hf: {index_file} names files {outside[:4]} that are "
                "not .safetensors files directly in the folder; fix the index's weight_map"
            )
        return [folder / name for name in names]
    if (folder / SAFETENSORS_FILE).is_file():
        return [folder / SAFETENSORS_FILE]
    raise HFInitError(
        f"checkpoint.initial_load_hf: {folder} has neither {SAFETENSORS_FILE} nor "
        f"{SAFETENSORS_INDEX}; point it at a Hugging Face model folder with safetensors weights"
    )


def _open_folder(folder: Path, stack: ExitStack) -> dict[str, _Source]:
    """Lazy handles on every tensor of the folder, open until ``stack`` closes."""
    sources: dict[str, _Source] = {}
    for path in _weight_files(folder):
        handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        for key in handle.keys():
            sources[key] = _Source(handle, key)
    return sources


def local_folder(folder: str | Path) -> Path:
    """``folder`` itself, or for an object-storage URI its node-local copy (fetched once per
    node and content, ``storage.folders.download_folder``)."""
    return download_folder(str(folder)) if is_remote(folder) else Path(folder)


def check_hf_config(spec: Any, model_args: Any, folder: str | Path) -> None:
    """Fail unless ``folder/config.json`` describes the same network as ``model_args``.

    Both sides go through the spec adapter's ``args_from_hf_config``, so only what the
    Hugging Face config can say is compared (not ``max_seq_len`` or loss settings).

    Raises:
        HFInitError: No adapter, no ``config.json``, or differing fields (all listed).
    """
    from transformers import AutoConfig

    folder = local_folder(folder)
    adapter = spec.state_dict_adapter
    if adapter is None:
        raise HFInitError(
            f"checkpoint.initial_load_hf is set but model '{spec.name}' has no "
            "state_dict_adapter (no Hugging Face counterpart); unset it or add an adapter"
        )
    if not (folder / "config.json").is_file():
        raise HFInitError(
            f"checkpoint.initial_load_hf: {folder / 'config.json'} not found; point it at a "
            "Hugging Face model folder (config.json + safetensors)"
        )
    theirs = adapter.args_from_hf_config(AutoConfig.from_pretrained(str(folder)))
    ours = adapter.args_from_hf_config(adapter.hf_config_from_args(model_args))
    differing = [
        f"{field.name}: folder {getattr(theirs, field.name)!r}, config {getattr(ours, field.name)!r}"
        for field in dataclasses.fields(ours)
        if field.name not in _IGNORED_ARGS
        and getattr(theirs, field.name) != getattr(ours, field.name)
    ]
    if differing:
        raise HFInitError(
            f"checkpoint.initial_load_hf: {folder / 'config.json'} does not match the configured "
            f"model ({spec.name}):\n  " + "\n  ".join(differing) + "\nSet model.flavor / "
            "model.overrides to the folder's values (or choose a matching folder)."
        )


def _local_indices(tensor: DTensor) -> list[torch.Tensor]:
    """For each dim, the global indices this rank holds.

    Sharding a probe (the global indices ``0 … n-1`` of one dim, size 1 elsewhere) with
    the placements that shard that dim and ``src_data_rank=None`` (no communication)
    gives the exact layout, also for ``_StridedShard`` (FSDP over expert-parallel
    experts). Placements on other dims do not move this dim's indices, so they are
    replicated, and each probe holds only ``n`` indices.
    """
    out = []
    for dim in range(tensor.ndim):
        # ``_StridedShard`` is no ``Shard`` subclass (``is_shard()`` is false), but has ``dim``.
        placements = [
            p if getattr(p, "dim", None) == dim else Replicate() for p in tensor.placements
        ]
        if all(isinstance(p, Replicate) for p in placements):
            out.append(torch.arange(tensor.shape[dim]))
            continue
        shape = [1] * tensor.ndim
        shape[dim] = tensor.shape[dim]
        probe = torch.arange(tensor.shape[dim]).view(shape)
        local = distribute_tensor(
            probe, tensor.device_mesh, placements, src_data_rank=None
        ).to_local()
        out.append(local.flatten().cpu())
    return out


def _read_rows(value: Any, indices: list[torch.Tensor]) -> torch.Tensor:
    """Read the bounding box of ``indices`` and keep exactly those rows of each dim."""
    box = tuple(slice(int(i.min()), int(i.max()) + 1) for i in indices)
    block = _read(value, box)
    for dim, (index, part) in enumerate(zip(indices, box, strict=True)):
        if not torch.equal(index, torch.arange(part.start, part.stop)):  # not one run
            block = block.index_select(dim, index - part.start)
    return block


@torch.no_grad()
def load_hf_weights(
    model_parts: Sequence[nn.Module], spec: Any, model_args: Any, folder: str | Path
) -> int:
    """Copy the folder's weights into the (sharded) model parts, in place.

    Args:
        model_parts: The parallelized model parts (FSDP / EP DTensors or plain tensors).
        spec: The train spec; its ``state_dict_adapter.from_hf`` maps the names.
        model_args: The configured model args, checked against ``config.json``.
        folder: The Hugging Face folder.

    Returns:
        Bytes read from the safetensors files by this rank.

    Raises:
        HFInitError: Config mismatch, missing files, or keys missing/extra after mapping.
    """
    folder = local_folder(folder)
    check_hf_config(spec, model_args, folder)
    with ExitStack() as stack:
        sources = _open_folder(folder, stack)
        _copy_weights(model_parts, spec, folder, sources)
    read_bytes = sum(source.read_bytes for source in sources.values())
    stored = sum(p.stat().st_size for p in _weight_files(folder))
    log.info("initialised from %s: this rank read %d of %d bytes", folder, read_bytes, stored)
    return read_bytes


def _copy_weights(
    model_parts: Sequence[nn.Module], spec: Any, folder: Path, sources: dict[str, _Source]
) -> None:
    ours = spec.state_dict_adapter.from_hf(sources)
    targets: dict[str, torch.Tensor] = {}
    for part in model_parts:
        targets.update(get_model_state_dict(part))
    # Parts an HF folder never holds (DeepSeek-V3's multi-token prediction) stay fresh.
    not_in_hf = getattr(spec.state_dict_adapter, "keys_not_in_hf", None)
    fresh = set(not_in_hf(targets)) if not_in_hf else set()
    if fresh:
        log.warning(
            "initial_load_hf: %d tensors (%s …) have no Hugging Face counterpart "
            "(multi-token prediction) and keep their fresh initialisation",
            len(fresh),
            sorted(fresh)[0],
        )
        targets = {k: v for k, v in targets.items() if k not in fresh}
    missing, extra = sorted(set(targets) - set(ours)), sorted(set(ours) - set(targets))
    if missing or extra:
        raise HFInitError(
            f"checkpoint.initial_load_hf: the weights of {folder} do not cover the model: "
            f"missing {missing[:8]}, unexpected {extra[:8]}"
        )
    for key, target in targets.items():
        value = ours[key]
        if tuple(value.shape) != tuple(target.shape):
            raise HFInitError(
                f"checkpoint.initial_load_hf: {key} has shape {tuple(value.shape)} in {folder}, "
                f"the model expects {tuple(target.shape)}"
            )
        local = target.to_local() if isinstance(target, DTensor) else target
        if not local.numel():
            continue
        indices = (
            _local_indices(target)
            if isinstance(target, DTensor)
            else [torch.arange(n) for n in target.shape]
        )
        block = _read_rows(value, indices)
        if tuple(block.shape) != tuple(local.shape):
            raise HFInitError(
                f"{key}: read a block of {tuple(block.shape)}, local shard is "
                f"{tuple(local.shape)} (unsupported placements {target.placements})"
            )
        local.copy_(block.to(device=local.device, dtype=local.dtype))
