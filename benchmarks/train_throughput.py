"""Training-step throughput on CPU: our trainer vs transformers' DeepseekV2ForCausalLM.

Both start from the same weights (ours converted with the spec's state-dict adapter), see
the same batches, and run a full training step: forward, cross-entropy, backward,
gradient clipping and AdamW. Ours is ``Trainer.train_step`` itself (one-rank FSDP2, the
fused chunked output-projection + cross-entropy, MoE bias update); transformers runs
eager PyTorch with the usual full-logits loss.

Ours runs as in a worker: fused AdamW and glibc told to keep freed memory mapped
(``keep_freed_memory_mapped``, set after the transformers run, which uses the default
allocator and torch's default AdamW as transformers' Trainer would).

Dtype policy: ours is timed in bf16 compute (FSDP2 mixed precision: fp32 master weights,
optimizer and loss math; bf16 matmuls) and in fp32; transformers in fp32 (its default
training dtype). The headline ratio is ours-bf16 / transformers-fp32; the same-dtype
ratio (both fp32) is printed too. MFU is against the measured matmul rate of the dtype
we compute in.

    .venv/bin/python benchmarks/train_throughput.py            # debugmodel, batch 4 × 256

The last line is one JSON object: ours_tps, hf_tps, ratio, mfu_pct, dtype, and the
fp32-vs-fp32 figures.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from titan_kedro.config import resolve_job_config
from titan_kedro.data.loader import TokenLoader
from titan_kedro.train.device import keep_freed_memory_mapped
from titan_kedro.train.grad_clip import clip_grad_norm_
from titan_kedro.train.metrics import measure_matmul_tflops
from titan_kedro.train.trainer import Trainer, build_model


def write_tokens(folder: Path, vocab: int, n_tokens: int, seed: int = 0) -> Path:
    """Random uint32 token files (throughput does not depend on the text)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "validation"):
        rng.integers(0, vocab, n_tokens, dtype=np.uint32).astype("<u4").tofile(
            folder / f"{split}.bin"
        )
    return folder


def job(tmp: Path, tokens: Path, args: argparse.Namespace, bf16: bool) -> dict[str, Any]:
    return {
        "job": {"seed": 0, "dump_folder": str(tmp / "job")},
        "data": {"token_dir": str(tokens)},
        "model": {"name": "deepseek_v2", "flavor": args.flavor},
        "training": {
            "steps": 1000,
            "seq_len": args.seq_len,
            "local_batch_size": args.batch,
            "device": "cpu",
            "num_threads": args.threads,
            "mixed_precision_cpu": bf16,
            "mixed_precision_param": "bfloat16",
        },
        "optimizer": {"lr": 1e-4},
        "lr_scheduler": {"warmup_steps": 0},
        "checkpoint": {"enable": False, "resume": "never", "folder": str(tmp / "ckpt")},
        "metrics": {"enable_mlflow": False, "peak_tflops": 1.0},
    }


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of a (one-rank FSDP) model's tensors."""
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone().float()
    return out


def time_ours(raw: dict[str, Any], warmup: int, steps: int) -> tuple[list[float], float, float]:
    trainer = Trainer(resolve_job_config(raw, source="benchmark"))
    try:
        losses, times = [], []
        for i in range(warmup + steps):
            start = time.perf_counter()
            metrics = trainer.train_step()
            elapsed = time.perf_counter() - start
            losses.append(metrics["loss"])
            if i >= warmup:
                times.append(elapsed)
        flops_per_token = trainer.flops_per_token
    finally:
        trainer.close()
    return losses, float(np.median(times)), flops_per_token


def time_hf(
    spec: Any,
    model_args: Any,
    weights: dict[str, torch.Tensor],
    tokens: np.ndarray,
    args: argparse.Namespace,
) -> tuple[list[float], float]:
    from transformers import DeepseekV2ForCausalLM

    adapter = spec.state_dict_adapter
    config = adapter.hf_config_from_args(model_args)
    config._attn_implementation = "sdpa"
    model = DeepseekV2ForCausalLM(config).float().train()
    missing, unexpected = model.load_state_dict(adapter.to_hf(weights), strict=False)
    if [k for k in missing if "rotary" not in k] or unexpected:
        raise RuntimeError(
            f"weight conversion mismatch: missing {missing}, unexpected {unexpected}"
        )
    # What transformers' Trainer builds by default ("adamw_torch"): torch's AdamW, default kernel.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    loader = TokenLoader(
        tokens, seq_len=args.seq_len, local_batch_size=args.batch, dp_rank=0, dp_degree=1, seed=0
    )
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        inputs, labels = next(loader)
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        elapsed = time.perf_counter() - start
        losses.append(loss.item())
        if i >= args.warmup:
            times.append(elapsed)
    return losses, float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--threads", type=int, default=0, help="0 = all cores")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        vocab = resolve_job_config(job(tmp, tmp, args, False)).model_args.vocab_size
        tokens_dir = write_tokens(tmp / "tokens", vocab, args.batch * (args.seq_len + 1) * 64)
        tokens = np.fromfile(tokens_dir / "train.bin", dtype="<u4")
        n_tok = args.batch * args.seq_len

        resolved = resolve_job_config(job(tmp, tokens_dir, args, False))
        weights = full_state(
            build_model(resolved.spec, resolved.model_args, 0, torch.device("cpu"))
        )
        # transformers first, with the default allocator; our worker then tunes it.
        hf_losses, hf_time = time_hf(resolved.spec, resolved.model_args, weights, tokens, args)
        del weights
        keep_freed_memory_mapped()
        bf16_losses, bf16_time, flops_tok = time_ours(
            job(tmp / "bf16", tokens_dir, args, True), args.warmup, args.steps
        )
        fp32_losses, fp32_time, _ = time_ours(
            job(tmp / "fp32", tokens_dir, args, False), args.warmup, args.steps
        )
        peak_bf16 = measure_matmul_tflops(torch.bfloat16, "cpu", min_seconds=1.0)
        peak_fp32 = measure_matmul_tflops(torch.float32, "cpu", min_seconds=1.0)

    ours_tps, ours32_tps, hf_tps = n_tok / bf16_time, n_tok / fp32_time, n_tok / hf_time
    mfu = 100 * ours_tps * flops_tok / 1e12 / peak_bf16
    mfu32 = 100 * ours32_tps * flops_tok / 1e12 / peak_fp32
    print(
        f"model deepseek_v2/{args.flavor}, batch {args.batch} × {args.seq_len}, threads {torch.get_num_threads()}, median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(
        f"first-step loss: ours fp32 {fp32_losses[0]:.5f}, ours bf16 {bf16_losses[0]:.5f}, transformers fp32 {hf_losses[0]:.5f}"
    )
    print(
        f"measured matmul peak: bf16 {peak_bf16 * 1e3:.0f} GFLOP/s, fp32 {peak_fp32 * 1e3:.0f} GFLOP/s"
    )
    print(
        f"ours (bf16 compute): {ours_tps:8.1f} tok/s  step {bf16_time:.3f}s  MFU {mfu:.1f}% of bf16 peak"
    )
    print(
        f"ours (fp32):         {ours32_tps:8.1f} tok/s  step {fp32_time:.3f}s  MFU {mfu32:.1f}% of fp32 peak"
    )
    print(f"transformers (fp32): {hf_tps:8.1f} tok/s  step {hf_time:.3f}s")
    print(
        f"ratio ours-bf16 / hf-fp32 {ours_tps / hf_tps:.2f}; same dtype (fp32/fp32) {ours32_tps / hf_tps:.2f}"
    )
    if not math.isclose(fp32_losses[0], hf_losses[0], rel_tol=1e-3):
        print("WARNING: the first-step losses differ; the weight conversion may be wrong")
    print(
        json.dumps(
            {
                "ours_tps": round(ours_tps, 1),
                "hf_tps": round(hf_tps, 1),
                "ratio": round(ours_tps / hf_tps, 3),
                "mfu_pct": round(mfu, 2),
                "dtype": "ours bfloat16 compute (fp32 master weights), transformers float32",
                "ours_fp32_tps": round(ours32_tps, 1),
                "same_dtype_ratio": round(ours32_tps / hf_tps, 3),
                "first_loss_ours_fp32": round(fp32_losses[0], 5),
                "first_loss_hf_fp32": round(hf_losses[0], 5),
            }
        )
    )


if __name__ == "__main__":
    main()
