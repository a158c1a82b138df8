"""Device and process-group setup: CUDA + NCCL when GPUs exist, CPU + gloo otherwise."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def resolve_device(kind: str = "auto", local_rank: int = 0) -> torch.device:
    """The device this rank computes on.

    Args:
        kind: ``auto`` (CUDA if available, else CPU), ``cpu`` or ``cuda``.
        local_rank: Index of this process on its node (picks the GPU).

    Raises:
        RuntimeError: ``cuda`` was asked for but no GPU is visible, or there are fewer GPUs
            than processes on this node.
    """
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "training.device=cuda but torch sees no GPU (torch.cuda.is_available() is False); "
            "use training.device=auto or cpu"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: only {count} visible; lower "
            "launch.nproc_per_node to the number of GPUs per node"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """``nccl`` for CUDA, ``gloo`` for CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def env_int(name: str, default: int) -> int:
    """An integer environment variable set by torchrun (``RANK``, ``WORLD_SIZE``, …)."""
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def init_process_group(device: torch.device, timeout_s: int = 600) -> None:
    """Join the process group torchrun describes in the environment (idempotent).

    Without torchrun's variables, a one-rank group on an in-memory store is created, so a
    single plain ``python`` process (a test, a notebook) runs the same code path.
    """
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    if "RANK" not in os.environ:
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    else:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun keeps one store across restarts of the worker group: without a prefix
        # per attempt, a restarted rank can read the address a dead rank published.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"titan_kedro/attempt_{attempt}/", store)
        kwargs.update(store=store, rank=rank, world_size=world_size)
    dist.init_process_group(backend=backend_for(device), timeout=timeout, **kwargs)


def set_cpu_threads(num_threads: int, local_world_size: int) -> int:
    """Give each local process its share of the cores (``num_threads`` 0 = cores / processes).

    Returns:
        The thread count now in effect.
    """
    if num_threads <= 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        num_threads = max(1, (cores or 1) // max(1, local_world_size))
    torch.set_num_threads(num_threads)
    return num_threads


def keep_freed_memory_mapped() -> bool:
    """Let glibc serve large CPU tensors from its heap and keep freed memory for reuse.

    By default glibc maps every allocation above 32 MiB freshly and unmaps it on free, so
    a training step that allocates hundreds of MB of logits, gradients and FSDP buffers
    pays page faults for all of them again every step. Disabling ``mmap`` allocations
    (``M_MMAP_MAX=0``) and heap trimming keeps that memory in the process for the next
    step. Call it once in a dedicated training process (it is process-wide). The worker
    does on CPU unless ``training.cpu_keep_freed_memory`` is false: the heap's holes then
    make the resident set 1.2–1.6 × the live tensors' growth (benchmarks/RESULTS.md,
    ``plan_vs_vmhwm.py``).

    Returns:
        True when applied (Linux with glibc), False otherwise.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_max = -1, -4
        ok = libc.mallopt(m_mmap_max, 0) == 1
        return ok and libc.mallopt(m_trim_threshold, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return False
