"""Values for the few small tensors a fake training step must read (counts, indices, flags).

Under ``FakeTensorMode`` a tensor has a shape but no values, so code that reads one
(``.tolist()`` of MoE token counts, ``int(counts.max())``, the fused loss's
``float(grad_out) == 1.0``) stops the step. ``KnownValues`` carries, beside each small
fake tensor whose values follow from what the step itself created, a real copy on the
CPU ("companion") and answers such reads from it. Values are known for

- tensors made by factory ops (``arange``, ``zeros``, ``ones_like``, ``full``…);
- results of ops whose tensor inputs all have companions (computed on the companions);
- ``bincount`` (the expert router's token counts): **balanced**, each of the
  ``minlength`` bins gets an equal share of the inputs — the plan assumes the load
  balancing it trains for;
- ``all_to_all_single`` of a known tensor: every rank is assumed to route as this one,
  so what arrives is what was sent.

Only scalars and integer or bool tensors of at most ``MAX_KNOWN_ELEMENTS`` elements get a
companion, so no weight or activation is ever computed for real.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from titan_kedro.plan.local_ops import LocalOpMode

MAX_KNOWN_ELEMENTS = 1 << 22
"""Largest tensor (elements) whose values are carried: routing indices of a micro-batch."""

_aten = torch.ops.aten
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")
_SHAPE_ONLY = {
    _aten.ones_like.default,
    _aten.zeros_like.default,
    _aten.full_like.default,
    _aten.new_ones.default,
    _aten.new_zeros.default,
    _aten.new_full.default,
}
"""Factories that read only their tensor argument's shape (``ones_like(loss)`` is the
gradient backward starts from)."""


class UnknownValueError(RuntimeError):
    """The fake step read a value that nothing in the step determines."""


class KnownValues(LocalOpMode):
    """Dispatch mode (entered inside ``FakeTensorMode``) that keeps small tensors' values."""

    def __init__(self) -> None:
        super().__init__()
        self._real: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def handle(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func is _aten._local_scalar_dense.default:
            return self._scalar(args[0])
        if func is _aten.bincount.default:
            return self._balanced_bincount(*args, **kwargs)
        if func is _aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            return _grouped_mm_output(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:
            return self._from_known_inputs(func, args, kwargs)
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self._pass_through(args, out)
        else:
            self._propagate(func, args, kwargs, out)
        return out

    def _scalar(self, tensor: torch.Tensor) -> Any:
        real = self._real.get(tensor)
        if real is None:
            raise UnknownValueError(
                f"the fake training step read the value of a {tuple(tensor.shape)} "
                f"{tensor.dtype} tensor that the step does not determine (only counts and "
                "indices derived from the step's own small tensors are known); the plan "
                "cannot measure this model's step — report the model code that reads it"
            )
        with _disable_current_modes():
            return real.item()

    def _balanced_bincount(
        self, values: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0
    ) -> torch.Tensor:
        if weights is not None or minlength <= 0:
            raise UnknownValueError(
                "bincount without minlength (or with weights) in a fake step: its size "
                "depends on data; pass minlength=<number of bins>"
            )
        total = values.numel()
        with _disable_current_modes():
            real = torch.full((minlength,), total // minlength, dtype=torch.int64)
            real[: total % minlength] += 1
        out = torch.empty(minlength, dtype=torch.int64, device=values.device)
        self._real[out] = real
        return out

    def _from_known_inputs(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An op whose output size depends on values (``repeat_interleave``): run it on the
        companions and hand on a fake tensor of the real result's shape."""
        real_out = self._run_real(func, args, kwargs)
        if real_out is None or not isinstance(real_out, torch.Tensor):
            raise UnknownValueError(
                f"{func} in the fake training step has an output size that depends on values "
                "the step does not determine"
            )
        device = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        out = torch.empty(real_out.shape, dtype=real_out.dtype, device=device.device)
        self._real[out] = real_out
        return out

    def _run_real(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func`` on the companions, or None when an input's values are unknown."""
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, FakeTensor)]
        if any(self._real.get(t) is None for t in inputs):
            return None
        real_args, real_kwargs = tree_map(
            lambda a: self._real.get(a, a) if isinstance(a, torch.Tensor) else _cpu(a),
            (args, kwargs),
        )
        with _disable_current_modes():
            return func(*real_args, **real_kwargs)

    def _pass_through(self, args: tuple[Any, ...], out: Any) -> None:
        real = self._real.get(args[0]) if args and isinstance(args[0], torch.Tensor) else None
        if real is not None and isinstance(out, torch.Tensor) and out.shape == real.shape:
            self._real[out] = real

    def _propagate(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outputs or any(not _small_count(t) for t in outputs):
            return
        if func in _SHAPE_ONLY:
            self._real[outputs[0]] = self._run_real(func, (_blank(args[0]), *args[1:]), kwargs)
            return
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(self._real.get(t) is None for t in inputs):
            for tensor in _written(func, args, kwargs):  # from unknown values: forget
                self._real.pop(tensor, None)
            return
        real_out = self._run_real(func, args, kwargs)
        for fake, real in zip(outputs, tree_flatten(real_out)[0], strict=False):
            if isinstance(real, torch.Tensor):
                self._real[fake] = real


def _grouped_mm_output(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The (empty) result of ``torch._grouped_mm`` in float32: its fake kernel accepts only
    bfloat16, while the CPU kernel the real step runs takes float32 as well."""
    groups = offs.numel() if offs is not None else 1
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        shape: tuple[int, ...] = (groups, mat_a.shape[0], mat_b.shape[1])
    elif mat_a.dim() == 2:
        shape = (mat_a.shape[0], mat_b.shape[-1])
    elif mat_b.dim() == 2:
        shape = (mat_a.shape[1], mat_b.shape[-1])
    else:
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    return mat_a.new_empty(shape, dtype=out_dtype or mat_a.dtype)


def _small_count(tensor: torch.Tensor) -> bool:
    """Whether values of ``tensor`` are carried: small integer/bool tensors and scalars."""
    if tensor.numel() == 1:
        return True
    return not tensor.dtype.is_floating_point and tensor.numel() <= MAX_KNOWN_ELEMENTS


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op writes in place (its schema's mutable arguments)."""
    written = []
    for index, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            written.append(value)
    return written


def _blank(tensor: torch.Tensor) -> torch.Tensor:
    """A real tensor of ``tensor``'s shape and dtype (for ops that read only those)."""
    with _disable_current_modes():
        return torch.zeros(tensor.shape, dtype=tensor.dtype)


def _cpu(value: Any) -> Any:
    return torch.device("cpu") if isinstance(value, torch.device) else value
