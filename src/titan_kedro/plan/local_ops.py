"""Base of the plan's dispatch modes: they see the local ops DTensor desugars into."""

from __future__ import annotations

from typing import Any
from unittest import mock

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode


class LocalOpMode(TorchDispatchMode):
    """A dispatch mode whose ``handle(func, args, kwargs)`` sees plain (local) tensors only.

    An op on ``DTensor`` arguments is handed back (``NotImplemented``) so DTensor runs it
    as local ops, which then come through here, as the memory trackers do. The op DTensor
    runs once more on fake global-shape tensors to infer its output's shape (the first
    time it meets a shape) is no work of this rank: it runs without ``handle``.
    """

    def __enter__(self) -> LocalOpMode:
        self._inferring = 0
        original = ShardingPropagator._propagate_tensor_meta_non_cached

        def infer(propagator: ShardingPropagator, op_schema: Any) -> Any:
            self._inferring += 1
            try:
                return original(propagator, op_schema)
            finally:
                self._inferring -= 1

        self._patch = mock.patch.object(
            ShardingPropagator, "_propagate_tensor_meta_non_cached", infer
        )
        self._patch.start()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._patch.stop()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented
        if getattr(self, "_inferring", 0):
            return func(*args, **(kwargs or {}))
        return self.handle(func, args, kwargs or {})

    def handle(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` (override to observe or replace it)."""
        return func(*args, **kwargs)
