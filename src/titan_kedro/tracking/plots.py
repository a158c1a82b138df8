"""Training-report figures from the workers' ``metrics.jsonl`` records.

Every function takes the parsed records (one dict per logged step, see
docs/ARCHITECTURE.md) and returns a ``matplotlib.figure.Figure`` built without pyplot, so
nothing depends on a display or on pyplot's global state.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure

MetricsRecord = dict[str, Any]

_FIGSIZE = (7.5, 4.2)
_MAX_HEATMAP_COLUMNS = 4


def parse_metrics_jsonl(text: str, *, source: str = "metrics.jsonl") -> list[MetricsRecord]:
    """Parse the workers' JSON-lines metrics into records merged by step, in step order.

    A step that appears more than once (a validation record beside the training record, or
    a resumed run that logged the step again) is merged; the later line wins per key.

    Args:
        text: The file's content.
        source: Where the text came from, quoted in error messages.

    Returns:
        One dict per step, sorted by ``step``.

    Raises:
        ValueError: A line is not a JSON object with an integer ``step``, or there is no
            record at all.
    """
    by_step: dict[int, MetricsRecord] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{source}, line {lineno}: not valid JSON ({err.msg}); the file may have been "
                "cut off by a crash: delete the broken line or rerun training"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(
                f"{source}, line {lineno}: expected a JSON object with an integer 'step', "
                f"got {line[:80]!r}"
            )
        by_step.setdefault(record["step"], {}).update(record)
    if not by_step:
        raise ValueError(
            f"{source} holds no metrics records; did training run at least metrics.log_freq steps?"
        )
    return [by_step[step] for step in sorted(by_step)]


def series(records: Iterable[Mapping[str, Any]], key: str, x: str = "step") -> tuple[list, list]:
    """The ``(x, y)`` points of every record that has a finite number under ``key``.

    ``x`` falls back to ``step`` for records that lack it.
    """
    xs: list[float] = []
    ys: list[float] = []
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            xs.append(record.get(x, record["step"]))
            ys.append(float(value))
    return xs, ys


def _empty(ax: Any, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, fontsize=12)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_loss(
    records: Sequence[Mapping[str, Any]],
    *,
    final_val_loss: float | None = None,
    final_tokens: int | None = None,
) -> Figure:
    """Training loss and validation loss against tokens seen.

    Args:
        records: Parsed metrics records.
        final_val_loss: The evaluation pipeline's loss on held-out tokens, drawn as a star.
        final_tokens: Tokens seen at the final checkpoint (x of the star).
    """
    fig = Figure(figsize=_FIGSIZE, layout="constrained")
    ax = fig.add_subplot()
    x_key = "tokens_seen" if any("tokens_seen" in r for r in records) else "step"
    xs, ys = series(records, "loss", x_key)
    if not xs:
        _empty(ax, "no 'loss' values in metrics.jsonl")
        return fig
    ax.plot(xs, ys, label="training loss", color="tab:blue", linewidth=1.2)
    vx, vy = series(records, "val_loss", x_key)
    if vx:
        ax.plot(vx, vy, "o-", label="validation loss (during training)", color="tab:orange")
    if final_val_loss is not None and math.isfinite(final_val_loss):
        ax.plot(
            [final_tokens if final_tokens is not None else xs[-1]],
            [final_val_loss],
            "*",
            markersize=14,
            color="tab:red",
            label=f"final validation loss {final_val_loss:.3f}",
        )
    ax.set_xlabel("tokens seen" if x_key == "tokens_seen" else "step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def plot_learning_rate(records: Sequence[Mapping[str, Any]]) -> Figure:
    """Learning rate against step (warmup and decay)."""
    fig = Figure(figsize=_FIGSIZE, layout="constrained")
    ax = fig.add_subplot()
    xs, ys = series(records, "lr")
    if not xs:
        _empty(ax, "no 'lr' values in metrics.jsonl")
        return fig
    ax.plot(xs, ys, color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title("Learning-rate schedule")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    return fig


def plot_throughput(records: Sequence[Mapping[str, Any]]) -> Figure:
    """Tokens per second (per device) and model FLOPs utilisation against step.

    A fault-tolerant run (``ft/participants`` in the records) gets a third panel: the
    replica groups that took part in each step.
    """
    panels = [("tps", "tokens/s per device", "tab:purple"), ("mfu_pct", "MFU (%)", "tab:brown")]
    if series(records, "ft/participants")[0]:
        panels.append(("ft/participants", "replica groups", "tab:red"))
    fig = Figure(figsize=(_FIGSIZE[0], _FIGSIZE[1] * 0.7 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (key, label, color) in zip(axes, panels, strict=True):
        xs, ys = series(records, key)
        if key == "ft/participants" and xs:
            ax.step(xs, ys, where="mid", color=color)
            ax.set_ylabel(label)
            ax.set_ylim(0, max(ys) + 0.5)
            ax.grid(alpha=0.3)
        elif xs:
            ax.plot(xs, ys, color=color)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        else:
            _empty(ax, f"no '{key}' values in metrics.jsonl")
    axes[0].set_title("Throughput")
    axes[-1].set_xlabel("step")
    return fig


def expert_load_matrix(records: Sequence[Mapping[str, Any]]) -> tuple[list[int], np.ndarray]:
    """Stack the records' ``expert_load`` into ``[steps, layers, experts]``.

    Returns:
        The steps that carry a load, and the array (empty with shape ``(0, 0, 0)`` for a
        dense model).

    Raises:
        ValueError: The records disagree on the number of layers or experts.
    """
    steps: list[int] = []
    loads: list[np.ndarray] = []
    for record in records:
        load = record.get("expert_load")
        if not load:
            continue
        arr = np.asarray(load, dtype=np.float64)
        if arr.ndim != 2:
            raise ValueError(
                f"metrics.jsonl step {record['step']}: 'expert_load' must be [layers][experts], "
                f"got shape {arr.shape}"
            )
        if loads and arr.shape != loads[0].shape:
            raise ValueError(
                f"metrics.jsonl step {record['step']}: 'expert_load' has shape {arr.shape}, "
                f"earlier steps {loads[0].shape}; was the model changed mid-run?"
            )
        steps.append(record["step"])
        loads.append(arr)
    if not loads:
        return [], np.zeros((0, 0, 0))
    return steps, np.stack(loads)


def plot_expert_load(records: Sequence[Mapping[str, Any]], *, model_label: str = "") -> Figure:
    """One heatmap per MoE layer: share of routed tokens per expert (x) over steps (y).

    A dense model (no ``expert_load`` in any record) gets a figure that says so.
    """
    steps, load = expert_load_matrix(records)
    if not steps:
        fig = Figure(figsize=_FIGSIZE, layout="constrained")
        ax = fig.add_subplot()
        label = f" ({model_label})" if model_label else ""
        _empty(ax, f"dense model{label}: no expert load")
        ax.set_title("MoE expert load")
        return fig
    n_layers, n_experts = load.shape[1], load.shape[2]
    cols = min(_MAX_HEATMAP_COLUMNS, n_layers)
    rows = math.ceil(n_layers / cols)
    fig = Figure(figsize=(3.2 * cols + 1.0, 2.6 * rows + 0.8), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    vmax = float(load.max()) or 1.0
    image = None
    for layer, ax in enumerate(axes):
        if layer >= n_layers:
            ax.set_visible(False)
            continue
        image = ax.imshow(
            load[:, layer, :],
            aspect="auto",
            origin="lower",
            interpolation="nearest",
            cmap="viridis",
            vmin=0.0,
            vmax=vmax,
            extent=(-0.5, n_experts - 0.5, steps[0] - 0.5, steps[-1] + 0.5),
        )
        ax.set_title(f"MoE layer {layer}", fontsize=9)
        ax.set_xlabel("expert", fontsize=8)
        ax.set_ylabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.colorbar(image, ax=axes.tolist(), label=f"share of tokens (balanced = {1 / n_experts:.3f})")
    fig.suptitle("MoE expert load over training" + (f" ({model_label})" if model_label else ""))
    return fig


def summarize_metrics(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Headline numbers of a run: first/final/min loss, last validation loss, mean speed.

    Throughput means skip the first logged step (it includes start-up and compilation).
    """
    _, loss = series(records, "loss")
    _, val = series(records, "val_loss")
    _, tps = series(records, "tps")
    _, mfu = series(records, "mfu_pct")
    _, mem = series(records, "memory_gib")

    def steady_mean(values: list[float]) -> float | None:
        tail = values[1:] or values
        return float(np.mean(tail)) if tail else None

    return {
        "logged_steps": len(records),
        "final_step": records[-1]["step"] if records else None,
        "tokens_seen": records[-1].get("tokens_seen") if records else None,
        "first_loss": loss[0] if loss else None,
        "final_loss": loss[-1] if loss else None,
        "min_loss": min(loss) if loss else None,
        "last_val_loss": val[-1] if val else None,
        "mean_tps": steady_mean(tps),
        "mean_mfu_pct": steady_mean(mfu),
        "peak_memory_gib": max(mem) if mem else None,
    }
