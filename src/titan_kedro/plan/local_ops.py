"""Base of the plan's dispatch modes: they see the local ops DTensor desugars into."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


class LocalOpMode(TorchDispatchMode):
    """A dispatch mode whose ``handle(func, args, kwargs)`` sees plain (local) tensors only.

    An op on ``DTensor`` arguments is handed back (``NotImplemented``) so DTensor runs it
    as local ops, which then come through here, as the memory trackers do.
    """

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented
        return self.handle(func, args, kwargs or {})

    def handle(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` (override to observe or replace it)."""
        return func(*args, **kwargs)
