"""Where our CPU training step spends its time: ``torch.profiler`` over a few ``train_step`` calls.

Same job as ``train_throughput.py`` (DeepSeek-V2 ``debugmodel``, batch 4 × 256, one rank).

    .venv/bin/python benchmarks/profile_train_step.py [--bf16] [--training compile=true]

Prints the top operators by self CPU time, grouped the way RESULTS.md quotes them.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile
from train_throughput import OursRunner, job, parse_training_override, write_tokens

from titan_kedro.config import resolve_job_config
from titan_kedro.train.device import keep_freed_memory_mapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--training", type=parse_training_override, action="append", default=[])
    args = parser.parse_args()
    keep_freed_memory_mapped()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        resolved = resolve_job_config(job(tmp, tmp, args, args.bf16))
        n_tokens = args.batch * (args.seq_len + 1) * 2 * (args.steps + 4)
        tokens_dir = write_tokens(tmp / "tokens", resolved.model_args.vocab_size, n_tokens, bos=0)
        runner = OursRunner(job(tmp / "run", tokens_dir, args, args.bf16))
        for _ in range(2):
            runner.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                runner.step()
        runner.trainer.close()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    print(table)


if __name__ == "__main__":
    main()
