"""Where our CPU training step spends its time: ``torch.profiler`` over a few ``train_step`` calls.

Same job as ``train_throughput.py`` (DeepSeek-V2 ``debugmodel``, batch 4 × 256, one rank).

    .venv/bin/python benchmarks/profile_train_step.py [--bf16] [--training compile=true]

Prints the top operators by self CPU time, then the step split into: model forward, fused
loss (output projection + cross-entropy, its gradients included), the rest of backward,
gradient clipping and the optimizer step (per step, milliseconds).
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from train_throughput import OursRunner, job, parse_training_override, write_tokens

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train import trainer as trainer_module
from titan_kedro.train.device import keep_freed_memory_mapped

SECTIONS = ("forward", "loss", "backward", "clip_grad_norm", "optimizer")


def labelled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


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
        trainer_module.clip_grad_norm_ = labelled("clip_grad_norm", trainer_module.clip_grad_norm_)
        runner = OursRunner(job(tmp / "run", tokens_dir, args, args.bf16))
        trainer = runner.trainer
        trainer.model.forward = labelled("forward", trainer.model.forward)
        trainer.loss_fn = labelled("loss", trainer.loss_fn)
        trainer.optimizers.step = labelled("optimizer", trainer.optimizers.step)
        original_backward = torch.Tensor.backward
        torch.Tensor.backward = labelled("backward", original_backward)  # type: ignore[method-assign]
        for _ in range(2):
            runner.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                runner.step()
        runner.trainer.close()
    torch.Tensor.backward = original_backward  # type: ignore[method-assign]
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    wall = {e.key: e.cpu_time_total / 1e3 / args.steps for e in averages if e.key in SECTIONS}
    step = sum(wall.values())
    print(f"per step (ms): total of sections {step:.0f}")
    for name in SECTIONS:
        print(f"  {name:15s} {wall.get(name, 0.0):7.0f}  {100 * wall.get(name, 0.0) / step:5.1f}%")


if __name__ == "__main__":
    main()
