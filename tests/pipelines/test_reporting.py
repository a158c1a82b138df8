"""Reporting: metrics.jsonl parsing, the figures' content, and the pipeline writing PNGs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner
from kedro_datasets.matplotlib import MatplotlibDataset

from titan_kedro.pipelines.reporting import create_pipeline
from titan_kedro.tracking import plots

N_LAYERS, N_EXPERTS = 3, 8


def synthetic_metrics(steps: int = 12, *, moe: bool = True, val_every: int = 4) -> str:
    """metrics.jsonl in the documented format; validation lands in separate records."""
    rng = np.random.default_rng(0)
    lines = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "tokens_seen": step * 128,
            "loss": 10.0 * math.exp(-step / 6) + 1.0,
            "grad_norm": 1.0,
            "lr": 1e-3 * min(1.0, step / 3),
            "tps": 1000.0 + step,
            "mfu_pct": 2.0 + 0.1 * step,
            "memory_gib": 1.5,
        }
        if moe:
            load = rng.dirichlet(np.ones(N_EXPERTS), size=N_LAYERS)
            record["expert_load"] = load.tolist()
        lines.append(json.dumps(record))
        if step % val_every == 0:
            lines.append(json.dumps({"step": step, "val_loss": 9.0 - step / 4}))
    return "\n".join(lines) + "\n"


def test_parse_merges_records_of_one_step_and_sorts() -> None:
    text = '{"step": 2, "loss": 3.0}\n\n{"step": 1, "loss": 4.0}\n{"step": 2, "val_loss": 3.5}\n'
    records = plots.parse_metrics_jsonl(text)
    assert [r["step"] for r in records] == [1, 2]
    assert records[1] == {"step": 2, "loss": 3.0, "val_loss": 3.5}


def test_parse_names_the_broken_line() -> None:
    with pytest.raises(ValueError, match=r"line 2: not valid JSON"):
        plots.parse_metrics_jsonl('{"step": 1}\n{"step": 2, "lo')
    with pytest.raises(ValueError, match=r"line 1: expected a JSON object with an integer 'step'"):
        plots.parse_metrics_jsonl('{"loss": 1.0}\n')
    with pytest.raises(ValueError, match="holds no metrics records"):
        plots.parse_metrics_jsonl("\n")


def test_loss_figure_plots_training_and_validation_against_tokens() -> None:
    records = plots.parse_metrics_jsonl(synthetic_metrics())
    fig = plots.plot_loss(records, final_val_loss=5.5, final_tokens=1536)
    ax = fig.axes[0]
    train, val, final = ax.lines
    assert list(train.get_xdata()) == [r["tokens_seen"] for r in records]
    assert list(train.get_ydata()) == pytest.approx([r["loss"] for r in records])
    assert list(val.get_xdata()) == [512, 1024, 1536]
    assert list(final.get_ydata()) == [5.5]
    assert ax.get_xlabel() == "tokens seen"


def test_learning_rate_and_throughput_figures_hold_the_series() -> None:
    records = plots.parse_metrics_jsonl(synthetic_metrics())
    lr_ax = plots.plot_learning_rate(records).axes[0]
    assert list(lr_ax.lines[0].get_ydata()) == pytest.approx([r["lr"] for r in records])
    tps_ax, mfu_ax = plots.plot_throughput(records).axes
    assert list(tps_ax.lines[0].get_ydata()) == [r["tps"] for r in records]
    assert list(mfu_ax.lines[0].get_ydata()) == pytest.approx([r["mfu_pct"] for r in records])


def test_expert_load_heatmap_has_one_panel_per_moe_layer() -> None:
    records = plots.parse_metrics_jsonl(synthetic_metrics())
    steps, load = plots.expert_load_matrix(records)
    assert steps == list(range(1, 13))
    assert load.shape == (12, N_LAYERS, N_EXPERTS)
    fig = plots.plot_expert_load(records, model_label="deepseek_v2/debugmodel")
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == N_LAYERS
    np.testing.assert_allclose(panels[1].images[0].get_array(), load[:, 1, :])


def test_dense_model_gets_a_clear_figure_instead_of_a_heatmap() -> None:
    records = plots.parse_metrics_jsonl(synthetic_metrics(moe=False))
    fig = plots.plot_expert_load(records, model_label="llama3/debugmodel")
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts == ["dense model (llama3/debugmodel): no expert load"]
    assert not any(ax.images for ax in fig.axes)


def test_expert_load_with_changing_shape_fails_clearly() -> None:
    text = (
        json.dumps({"step": 1, "expert_load": [[0.5, 0.5]]})
        + "\n"
        + json.dumps({"step": 2, "expert_load": [[0.3, 0.3, 0.4]]})
    )
    with pytest.raises(ValueError, match="step 2: 'expert_load' has shape"):
        plots.expert_load_matrix(plots.parse_metrics_jsonl(text))


def test_reporting_pipeline_writes_pngs_and_a_summary(tmp_path: Path) -> None:
    figures = ["loss_plot", "learning_rate_plot", "throughput_plot", "expert_load_plot"]
    catalog = DataCatalog(
        {
            "training_metrics_jsonl": MemoryDataset(synthetic_metrics()),
            "training_summary": MemoryDataset({"tokens_seen": 1536, "wall_time_s": 3.0}),
            "evaluation_results": MemoryDataset({"eval_loss": 5.5, "eval_perplexity": 244.7}),
            "params:model": MemoryDataset({"name": "deepseek_v2", "flavor": "debugmodel"}),
            **{name: MatplotlibDataset(filepath=str(tmp_path / f"{name}.png")) for name in figures},
        }
    )
    catalog["reporting_summary"] = MemoryDataset()
    SequentialRunner().run(create_pipeline(), catalog)
    for name in figures:
        png = (tmp_path / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5_000
    summary = catalog["reporting_summary"].load()
    assert summary["first_loss"] > summary["final_loss"]
    assert summary["final_step"] == 12
    assert summary["eval_loss"] == 5.5
    assert summary["mean_tps"] == pytest.approx(np.mean([1000.0 + s for s in range(2, 13)]))
