"""Step-time cost of fault tolerance: G = 2 TorchFT replica groups vs plain HSDP, on CPU.

Both layouts train the same model on the same global batch with the same data:

- ``hsdp``: one torchrun of 2 ranks, ``data_parallel_replicate_degree=2`` (FSDP2's
  all-reduce of gradients over the replicas);
- ``ft``: two torchrun groups of 1 rank each (``fault_tolerance.enable``, the lighthouse
  in this process), gradients averaged through the TorchFT manager, a quorum and a commit
  vote every step.

The layouts alternate, one run each per round (paired, so load drift on a shared machine
hits both alike). A run's step time is the median of its ``step_time_s`` (from
``metrics.jsonl``) after ``--warmup`` steps; the headline ``ratio`` is the median over
rounds of ft / hsdp (above 1: FT is slower). The load average is printed with the result.

    .venv/bin/python benchmarks/ft_overhead.py             # debugmodel, 3 rounds × 20 steps
    .venv/bin/python benchmarks/ft_overhead.py --quick     # 1 round × 12 steps

The last line is one JSON object: hsdp_step_s, ft_step_s, ratio, rounds, per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from train_throughput import write_tokens

from titan_kedro.config import dump_job_config
from titan_kedro.launch.replica_groups import ReplicaGroupLauncher
from titan_kedro.models.resolve import resolve_job_config

REPO = Path(__file__).resolve().parents[1]


def job(folder: Path, tokens: Path, args: argparse.Namespace, *, ft: bool) -> dict[str, Any]:
    """The raw config of one run (``ft``: 2 groups × 1 rank, else HSDP over 2 ranks)."""
    return {
        "job": {"seed": 0, "dump_folder": str(folder / "job")},
        "data": {"token_dir": str(tokens)},
        "model": {"name": "deepseek_v2", "flavor": "debugmodel", "overrides": {"n_layers": 2}},
        "training": {"steps": args.steps, "seq_len": args.seq_len, "local_batch_size": args.batch,
                     "device": "cpu", "num_threads": 1},
        "lr_scheduler": {"warmup_steps": 2},
        "parallelism": {"expert_parallel_degree": 1,
                        "data_parallel_replicate_degree": 1 if ft else 2},
        "launch": {"nproc_per_node": 1 if ft else 2, "log_dir": str(folder / "logs")},
        "checkpoint": {"enable": False, "folder": str(folder / "ckpt")},
        "metrics": {"enable_mlflow": False, "peak_tflops": 1.0, "system_metrics_interval_s": 0},
        "fault_tolerance": {"enable": ft, "replica_groups": 2 if ft else 1},
    }  # fmt: skip


def median_step_s(dump_folder: Path, warmup: int) -> float:
    """Median ``step_time_s`` after ``warmup`` steps."""
    rows = [json.loads(line) for line in (dump_folder / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows if r["step"] > warmup)


def run(folder: Path, raw: dict[str, Any], *, ft: bool) -> None:
    """Train one layout to completion (output to ``folder/console.log``)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = resolve_job_config(raw).config
    config = dump_job_config(cfg, folder / "job_config.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with (folder / "console.log").open("w") as console:
        if ft:
            ReplicaGroupLauncher(
                cfg, config, console=console, extra_env={"OMP_NUM_THREADS": "1"}
            ).run()
            return
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "-m", "titan_kedro.train", "--config", str(config)]  # fmt: skip
        subprocess.run(cmd, env=env, stdout=console, stderr=subprocess.STDOUT, check=True, cwd=REPO)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 round × 12 steps")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 12
    with tempfile.TemporaryDirectory(prefix="ft_overhead_") as tmp_name:
        tmp = Path(tmp_name)
        tokens = write_tokens(tmp / "tokens", vocab=102400, n_tokens=400_000, bos=100000)
        hsdp, ft = [], []
        for index in range(args.rounds):
            for layout, times in (("hsdp", hsdp), ("ft", ft)):
                folder = tmp / f"{layout}-{index}"
                run(folder, job(folder, tokens, args, ft=layout == "ft"), ft=layout == "ft")
                times.append(median_step_s(folder / "job", args.warmup))
            print(f"round {index}: hsdp {hsdp[-1]:.4f}s  ft {ft[-1]:.4f}s  "
                  f"ratio {ft[-1] / hsdp[-1]:.3f}", flush=True)  # fmt: skip
    ratios = [f / h for f, h in zip(ft, hsdp, strict=True)]
    result = {
        "hsdp_step_s": statistics.median(hsdp),
        "ft_step_s": statistics.median(ft),
        "ratio": statistics.median(ratios),
        "round_ratios": [round(r, 4) for r in ratios],
        "rounds": args.rounds,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "load_average": os.getloadavg(),
    }
    print(yaml.safe_dump({"command": " ".join(sys.argv)}).strip())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
