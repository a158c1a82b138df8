"""Metric helpers: GPU peak table, expert-load statistics, console line, MLflow sink choice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_kedro.tracking.mlflow_logger import MlflowMetricsSink
from titan_kedro.train.metrics import (
    MetricsLogger,
    expert_load_stats,
    format_line,
    gpu_peak_tflops,
    measure_matmul_tflops,
    memory_metrics,
)


def test_gpu_peak_table_matches_marketing_names() -> None:
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_peak_tflops("NVIDIA H200") == 989.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("NVIDIA L40S") == 362.0  # not L4 or L40
    assert gpu_peak_tflops("Some Future GPU") is None


def test_expert_load_statistics() -> None:
    load = torch.tensor([[4.0, 4.0, 4.0, 4.0], [12.0, 4.0, 0.0, 0.0]])
    stats = expert_load_stats(load)
    assert stats["moe_max_load_ratio"] == pytest.approx(3.0)  # 12 over a mean of 4
    assert stats["moe_dead_expert_frac"] == pytest.approx(2 / 8)
    assert stats["expert_load"] == [[0.25] * 4, [0.75, 0.25, 0.0, 0.0]]


def test_console_line_and_jsonl_rows(tmp_path: Path) -> None:
    line = format_line(3, 60, {"loss": 2.5, "tps": 1234.5, "mfu_pct": 12.345})
    assert line.startswith("step  3/60") and "loss 2.5000" in line and "tps 1,234" in line
    logger = MetricsLogger(tmp_path, 10, progress=False)
    logger.log(1, {"loss": float("nan"), "tps": 5.0})
    logger.close()
    (row,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row == {"step": 1, "loss": None, "tps": 5.0}
    MetricsLogger(tmp_path, 10, progress=False).close()  # a fresh run starts the file over
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_mlflow_sink_needs_a_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    assert MlflowMetricsSink.from_env() is None
    monkeypatch.setenv("MLFLOW_RUN_ID", "abc")
    assert MlflowMetricsSink.from_env(enable=False) is None


SINK_SCRIPT = """
import sys
from titan_kedro.tracking.mlflow_logger import MlflowMetricsSink

sink = MlflowMetricsSink(sys.argv[1], sys.argv[2])
print("mlflow" in sys.modules)  # a rank that never logs never pays for MLflow
sink.log({"loss": 2.5, "note": "text"}, step=3)
print("mlflow" in sys.modules)
"""


def test_the_sink_opens_mlflow_at_its_first_log_and_logs_into_the_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient
    from mlflow_store import migrated_store

    uri = migrated_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("sink"))
    proc = subprocess.run(
        [sys.executable, "-c", SINK_SCRIPT, run.info.run_id, uri],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "True"]
    (point,) = client.get_metric_history(run.info.run_id, "loss")
    assert (point.step, point.value) == (3, 2.5)


def test_matmul_rate_is_positive() -> None:
    assert measure_matmul_tflops(torch.float32, "cpu", size=128, min_seconds=0.01) > 0


def test_a_continued_run_appends_only_to_its_own_metrics_file(tmp_path: Path) -> None:
    def rows() -> list[int]:
        return [
            json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
        ]

    first = MetricsLogger(tmp_path, 4, progress=False, run_id="run-a")
    first.log(1, {"loss": 2.0})
    first.close()
    again = MetricsLogger(tmp_path, 4, start_step=1, progress=False, append=True, run_id="run-a")
    again.log(2, {"loss": 1.5})
    again.close()
    assert rows() == [1, 2]
    other = MetricsLogger(tmp_path, 4, start_step=1, progress=False, append=True, run_id="run-b")
    other.log(2, {"loss": 9.0})
    other.close()
    assert rows() == [2]  # run-a's rows are not mixed into run-b's continuation


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_cpu_memory_metrics_report_the_peak_resident_set_which_a_freed_block_keeps() -> None:
    before = memory_metrics(torch.device("cpu"))
    # This process may have peaked above what it holds now (an earlier test): the block
    # fills that gap and then 64 MiB more, so the peak must rise by 60 MiB or more.
    gap_gib = max(0.0, before["vmhwm_gib"] - before["memory_gib"])
    block = torch.ones(int((gap_gib + 64 / 1024) * 2**30) // 4)  # written: resident
    during = memory_metrics(torch.device("cpu"))
    del block
    after = memory_metrics(torch.device("cpu"))
    assert "memory_allocated_gib" not in during
    assert during["vmhwm_gib"] >= max(during["memory_gib"], before["vmhwm_gib"] + 60 / 1024)
    # The peak stays when the block goes (up to the kernel's batched per-thread RSS counts).
    assert after["vmhwm_gib"] >= during["vmhwm_gib"] - 1 / 1024
