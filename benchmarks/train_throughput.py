"""Training-step throughput on CPU: our trainer vs transformers, at the same precision.

Four runners start from the same weights (ours converted with the spec's state-dict
adapter), see the same batches and run a full training step each: forward, cross-entropy,
backward, gradient clipping and AdamW.

- ``ours_bf16``: ``Trainer.train_step`` with ``training.mixed_precision_cpu`` (bf16
  matmuls, fp32 master weights, optimizer state and loss math), ``training.compile``
  (regional: each block and the fused loss's chunk; compiling happens in the warm-up
  rounds, which are not timed; ``--training compile=false`` for eager) and document
  masking (the token stream holds documents; transformers attends across them, which
  is less work);
- ``ours_fp32``: the same trainer in float32;
- ``hf_bf16``: transformers' ``DeepseekV2ForCausalLM`` (sdpa attention, its default)
  with forward and loss under ``torch.autocast("cpu", dtype=torch.bfloat16)``, which is
  what its ``Trainer`` does with ``bf16=True``; fp32 master weights;
- ``hf_fp32``: the same model in float32.

transformers gets the optimizer its ``Trainer`` picks by default on torch >= 2.8
(``adamw_torch_fused``: fused ``torch.optim.AdamW``) and ``torch.nn.utils.clip_grad_norm_``.

Like with like: every runner lives in this one process, so the allocator setting (glibc
keeps freed memory mapped, ``keep_freed_memory_mapped``, which our workers also use) and
the thread count are the same for all. The runners step in turn (one step each per
round), so load drift on a shared machine hits all alike; each ratio is the median over
rounds of the per-round ratio (paired), the tokens/s figures are medians of step times.
The load average is printed with the result.

Headline ``ratio`` = ours bf16 / transformers bf16; ``fp32_ratio`` = ours fp32 /
transformers fp32. ``mfu_pct`` is ours bf16 against the bf16 matmul rate measured in this
run (``peak_tflops``, the best of six 1024² matmul measurements around the rounds);
``mfu_fp32_pct`` ours fp32 against the fp32 rate. ``ratio_ceiling`` and
``fp32_ratio_ceiling`` are what a runner doing nothing but the step's FLOPs at that rate
would score against transformers: the bound on any ratio this benchmark can show.

    .venv/bin/python benchmarks/train_throughput.py            # debugmodel, batch 4 × 256
    .venv/bin/python benchmarks/train_throughput.py --quick    # fewer rounds (about 1 min)

The last line is one JSON object: ours_tps, hf_tps, ratio, dtype, ours_fp32_tps,
hf_fp32_tps, fp32_ratio, mfu_pct, peak_tflops and more.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from titan_kedro.data.loader import TokenLoader
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.train.device import keep_freed_memory_mapped
from titan_kedro.train.metrics import measure_matmul_tflops
from titan_kedro.train.trainer import Trainer, build_model


def write_tokens(folder: Path, vocab: int, n_tokens: int, bos: int, seed: int = 0) -> Path:
    """Random token files packed as ``BOS doc EOS BOS doc EOS …`` (documents of 40–400 tokens)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "validation"):
        tokens = rng.integers(2, vocab, n_tokens, dtype=np.uint32)
        starts = np.cumsum(rng.integers(40, 400, n_tokens // 40))
        tokens[starts[starts < n_tokens]] = bos
        tokens.astype("<u4").tofile(folder / f"{split}.bin")
    # The BOS id lets our trainer find the documents (training.document_masking).
    (folder / "metadata.json").write_text(json.dumps({"vocab_size": vocab, "bos_id": bos}))
    return folder


def job(tmp: Path, tokens: Path, args: argparse.Namespace, bf16: bool) -> dict[str, Any]:
    training: dict[str, Any] = {
        "steps": 1000,
        "seq_len": args.seq_len,
        "local_batch_size": args.batch,
        "device": "cpu",
        "num_threads": args.threads,
        "mixed_precision_cpu": bf16,
        "mixed_precision_param": "bfloat16",
        "compile": True,
    }
    for key, value in args.training:
        training[key] = value
    return {
        "job": {"seed": 0, "dump_folder": str(tmp / "job")},
        "data": {"token_dir": str(tokens)},
        "model": {"name": "deepseek_v2", "flavor": args.flavor},
        "training": training,
        "optimizer": {"lr": 1e-4},
        "lr_scheduler": {"warmup_steps": 0},
        "checkpoint": {"enable": False, "resume": "never", "folder": str(tmp / "ckpt")},
        "metrics": {"enable_mlflow": False, "peak_tflops": 1.0},
    }


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded float32 copies of a model's tensors."""
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone().float()
    return out


class OursRunner:
    """Our training step: ``Trainer.train_step`` of a one-rank worker."""

    def __init__(self, raw: dict[str, Any]):
        self.trainer = Trainer(resolve_job_config(raw, source="benchmark"))
        self.flops_per_token = self.trainer.flops_per_token

    def step(self) -> float:
        return float(self.trainer.train_step()["loss"])


class HFRunner:
    """transformers' DeepseekV2ForCausalLM trained as its Trainer would (fp32 or autocast bf16)."""

    def __init__(
        self,
        spec: Any,
        model_args: Any,
        weights: dict[str, torch.Tensor],
        tokens: np.ndarray,
        args: argparse.Namespace,
        *,
        bf16: bool,
    ):
        from transformers import DeepseekV2ForCausalLM

        adapter = spec.state_dict_adapter
        config = adapter.hf_config_from_args(model_args)
        config._attn_implementation = "sdpa"
        self.model = DeepseekV2ForCausalLM(config).float().train()
        missing, unexpected = self.model.load_state_dict(adapter.to_hf(weights), strict=False)
        if [k for k in missing if "rotary" not in k] or unexpected:
            raise RuntimeError(
                f"weight conversion mismatch: missing {missing}, unexpected {unexpected}"
            )
        self.bf16 = bf16
        # transformers' Trainer default on torch >= 2.8 ("adamw_torch_fused").
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
        )
        self.loader = TokenLoader(
            tokens,
            seq_len=args.seq_len,
            local_batch_size=args.batch,
            data_rank=0,
            data_ranks=1,
            seed=0,
        )

    def step(self) -> float:
        inputs, labels = next(self.loader)
        self.opt.zero_grad(set_to_none=True)
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        )
        with autocast:
            logits = self.model(input_ids=inputs).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.item()


def timed_rounds(
    runners: dict[str, Any], warmup: int, steps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Step times and losses of each runner, one step each per round (load drift hits all alike)."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    losses: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(warmup + steps):
        for name, runner in runners.items():
            start = time.perf_counter()
            losses[name].append(runner.step())
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return times, losses


def best_matmul_rate(dtype: torch.dtype, tries: int = 3) -> float:
    """Best of a few 1024² matmul rate measurements, TFLOP/s (the MFU denominator)."""
    return max(measure_matmul_tflops(dtype, "cpu", min_seconds=0.5) for _ in range(tries))


def paired_ratio(slow: list[float], fast: list[float]) -> float:
    """Median over rounds of ``slow_time / fast_time`` (a throughput ratio fast / slow)."""
    return float(np.median(np.asarray(slow) / np.asarray(fast)))


def parse_training_override(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    return key, json.loads(value) if value[:1] in '0123456789-[{tf"n' else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7, help="timed rounds (medians reported)")
    parser.add_argument("--quick", action="store_true", help="1 warm-up and 3 timed rounds")
    parser.add_argument("--threads", type=int, default=0, help="0 = all cores")
    parser.add_argument(
        "--training",
        type=parse_training_override,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra training-section setting for our runners, e.g. compile=true",
    )
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.steps = 1, 3

    keep_freed_memory_mapped()  # for every runner: they all live in this process
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        resolved = resolve_job_config(job(tmp, tmp, args, False))
        vocab = resolved.model_args.vocab_size
        n_windows = 2 * (args.warmup + args.steps + 2)
        tokens_dir = write_tokens(
            tmp / "tokens", vocab, args.batch * (args.seq_len + 1) * n_windows, bos=0
        )
        tokens = np.fromfile(tokens_dir / "train.bin", dtype="<u4")
        weights = full_state(
            build_model(resolved.spec, resolved.model_args, 0, torch.device("cpu"))
        )
        runners: dict[str, Any] = {
            "ours_bf16": OursRunner(job(tmp / "bf16", tokens_dir, args, True)),
            "hf_bf16": HFRunner(
                resolved.spec, resolved.model_args, weights, tokens, args, bf16=True
            ),
            "ours_fp32": OursRunner(job(tmp / "fp32", tokens_dir, args, False)),
            "hf_fp32": HFRunner(
                resolved.spec, resolved.model_args, weights, tokens, args, bf16=False
            ),
        }
        del weights
        # Our Trainer sets the thread count when built; the same count then holds for all.
        threads = torch.get_num_threads()
        # The matmul rate is measured three times before and after the rounds; the best
        # counts (a busy machine only lowers it, so the MFU quoted is the conservative one).
        peak_bf16, peak_fp32 = best_matmul_rate(torch.bfloat16), best_matmul_rate(torch.float32)
        times, losses = timed_rounds(runners, args.warmup, args.steps)
        flops_tok = runners["ours_bf16"].flops_per_token
        masking = runners["ours_bf16"].trainer.document_bos is not None
        runners["ours_bf16"].trainer.close()
        peak_bf16 = max(peak_bf16, best_matmul_rate(torch.bfloat16))
        peak_fp32 = max(peak_fp32, best_matmul_rate(torch.float32))
    load_after = os.getloadavg()

    n_tok = args.batch * args.seq_len
    tps = {name: n_tok / float(np.median(t)) for name, t in times.items()}
    ratio = paired_ratio(times["hf_bf16"], times["ours_bf16"])
    fp32_ratio = paired_ratio(times["hf_fp32"], times["ours_fp32"])
    mfu = 100 * tps["ours_bf16"] * flops_tok / 1e12 / peak_bf16
    mfu32 = 100 * tps["ours_fp32"] * flops_tok / 1e12 / peak_fp32
    hf_mfu = 100 * tps["hf_bf16"] * flops_tok / 1e12 / peak_bf16
    # The most any runner could reach: the step's FLOPs at the measured matmul rate, no
    # other work. ceiling = transformers' step time / that time.
    ceiling = peak_bf16 * 1e12 / (tps["hf_bf16"] * flops_tok)
    fp32_ceiling = peak_fp32 * 1e12 / (tps["hf_fp32"] * flops_tok)
    extra = ", ".join(f"{k}={v}" for k, v in args.training) or "defaults"
    print(
        f"model deepseek_v2/{args.flavor}, batch {args.batch} × {args.seq_len}, {threads} threads, "
        f"median of {args.steps} rounds after {args.warmup} warm-up; our training settings: "
        f"{extra}; our document masking {'on' if masking else 'off'} (transformers: none)"
    )
    print(
        f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}; "
        f"matmul rate: bf16 {peak_bf16 * 1e3:.0f} GFLOP/s, fp32 {peak_fp32 * 1e3:.0f} GFLOP/s"
    )
    print(
        "first-step loss: "
        + ", ".join(f"{name} {values[0]:.5f}" for name, values in losses.items())
    )
    for name in runners:
        print(f"  {name:10s} {tps[name]:8.1f} tok/s  step {float(np.median(times[name])):.3f}s")
    print(
        f"ratio (paired) bf16 ours/transformers {ratio:.2f}; fp32 {fp32_ratio:.2f}; "
        f"MFU ours bf16 {mfu:.1f}% (transformers {hf_mfu:.1f}%) of the bf16 rate, "
        f"ours fp32 {mfu32:.1f}% of the fp32 rate"
    )
    print(
        f"ceiling (every FLOP at the measured matmul rate, nothing else): {ceiling:.2f}× "
        f"transformers at bf16, {fp32_ceiling:.2f}× at fp32; 1.5× at fp32 needs "
        f"{100 * 1.5 / fp32_ceiling:.0f}% MFU for the whole step"
    )
    if not math.isclose(losses["ours_fp32"][0], losses["hf_fp32"][0], rel_tol=1e-3):
        print("WARNING: the fp32 first-step losses differ; the weight conversion may be wrong")
    if not math.isclose(losses["ours_bf16"][0], losses["hf_bf16"][0], rel_tol=1e-2):
        print("WARNING: the bf16 first-step losses differ by more than bf16 rounding")
    print(
        json.dumps(
            {
                "ours_tps": round(tps["ours_bf16"], 1),
                "hf_tps": round(tps["hf_bf16"], 1),
                "ratio": round(ratio, 3),
                "dtype": "bfloat16 compute, fp32 master weights (transformers: autocast bf16)",
                "ours_fp32_tps": round(tps["ours_fp32"], 1),
                "hf_fp32_tps": round(tps["hf_fp32"], 1),
                "fp32_ratio": round(fp32_ratio, 3),
                "mfu_pct": round(mfu, 2),
                "peak_tflops": round(peak_bf16, 4),
                "mfu_fp32_pct": round(mfu32, 2),
                "peak_fp32_tflops": round(peak_fp32, 4),
                "ratio_ceiling": round(ceiling, 3),
                "fp32_ratio_ceiling": round(fp32_ceiling, 3),
                "threads": threads,
                "rounds": args.steps,
                "loadavg_before": round(load_before[0], 2),
                "loadavg_after": round(load_after[0], 2),
                "training_overrides": dict(args.training),
                "ours_document_masking": masking,
                "first_loss": {k: round(v[0], 5) for k, v in losses.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
