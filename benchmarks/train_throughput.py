"""Training-step throughput on CPU: our trainer vs transformers' DeepseekV2ForCausalLM.

Both start from the same weights (ours converted with the spec's state-dict adapter), see
the same batches, and run a full training step: forward, cross-entropy, backward,
gradient clipping and AdamW. Ours is ``Trainer.train_step`` itself (one-rank FSDP2, the
fused chunked output-projection + cross-entropy, fused AdamW, MoE bias update);
transformers runs eager PyTorch with the usual full-logits loss and torch's default
AdamW, as its Trainer would.

Fairness: our workers tell glibc to keep freed memory mapped (``keep_freed_memory_mapped``,
process-wide). transformers is therefore timed twice: first alone with the default
allocator (how its users run it), then with the same allocator setting as ours and
stepped in turn with our runs, so load drift on a shared machine hits all alike. The
headline ``hf_tps`` / ``ratio`` use that second, allocator-neutral run (the stricter
baseline); the default-allocator figure is reported as ``hf_default_tps``.

Dtype policy: ours is timed in bf16 compute (``training.mixed_precision_cpu``: FSDP2 mixed
precision with fp32 master weights, optimizer and loss math, bf16 matmuls) and in fp32;
transformers in fp32 (its default training dtype). The headline ratio is ours-bf16 /
transformers-fp32; the same-dtype ratio (both fp32) is reported too. MFU is against the
measured matmul rate of the dtype we compute in.

    .venv/bin/python benchmarks/train_throughput.py            # debugmodel, batch 4 × 256

The last line is one JSON object: ours_tps, hf_tps, ratio, mfu_pct, dtype and more.
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


class OursRunner:
    """Our training step: ``Trainer.train_step`` of a one-rank worker."""

    def __init__(self, raw: dict[str, Any]):
        self.trainer = Trainer(resolve_job_config(raw, source="benchmark"))
        self.flops_per_token = self.trainer.flops_per_token

    def step(self) -> float:
        return float(self.trainer.train_step()["loss"])


class HFRunner:
    """transformers' DeepseekV2ForCausalLM trained the plain PyTorch way."""

    def __init__(
        self,
        spec: Any,
        model_args: Any,
        weights: dict[str, torch.Tensor],
        tokens: np.ndarray,
        args: argparse.Namespace,
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
        # What transformers' Trainer builds by default ("adamw_torch"): torch's AdamW.
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1
        )
        self.loader = TokenLoader(
            tokens,
            seq_len=args.seq_len,
            local_batch_size=args.batch,
            dp_rank=0,
            dp_degree=1,
            seed=0,
        )

    def step(self) -> float:
        inputs, labels = next(self.loader)
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        clip_grad_norm_(list(self.model.parameters()), 1.0)
        self.opt.step()
        return loss.item()


def timed_rounds(
    runners: dict[str, Any], warmup: int, steps: int
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Median step time of each runner, stepping them in turn (load drift hits all alike)."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    losses: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(warmup + steps):
        for name, runner in runners.items():
            start = time.perf_counter()
            losses[name].append(runner.step())
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}, losses


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
        resolved = resolve_job_config(job(tmp, tmp, args, False))
        vocab = resolved.model_args.vocab_size
        n_windows = 2 * (args.warmup + args.steps + 2)
        tokens_dir = write_tokens(
            tmp / "tokens", vocab, args.batch * (args.seq_len + 1) * n_windows
        )
        tokens = np.fromfile(tokens_dir / "train.bin", dtype="<u4")
        weights = full_state(
            build_model(resolved.spec, resolved.model_args, 0, torch.device("cpu"))
        )

        default_times, _ = timed_rounds(
            {"hf": HFRunner(resolved.spec, resolved.model_args, weights, tokens, args)},
            args.warmup,
            args.steps,
        )
        keep_freed_memory_mapped()
        runners = {
            "ours_bf16": OursRunner(job(tmp / "bf16", tokens_dir, args, True)),
            "ours_fp32": OursRunner(job(tmp / "fp32", tokens_dir, args, False)),
            "hf": HFRunner(resolved.spec, resolved.model_args, weights, tokens, args),
        }
        del weights
        times, losses = timed_rounds(runners, args.warmup, args.steps)
        flops_tok = runners["ours_bf16"].flops_per_token
        runners["ours_bf16"].trainer.close()
        peak_bf16 = measure_matmul_tflops(torch.bfloat16, "cpu", min_seconds=1.0)
        peak_fp32 = measure_matmul_tflops(torch.float32, "cpu", min_seconds=1.0)

    n_tok = args.batch * args.seq_len
    tps = {name: n_tok / t for name, t in times.items()}
    hf_default_tps = n_tok / default_times["hf"]
    mfu = 100 * tps["ours_bf16"] * flops_tok / 1e12 / peak_bf16
    mfu32 = 100 * tps["ours_fp32"] * flops_tok / 1e12 / peak_fp32
    ratio, same_dtype = tps["ours_bf16"] / tps["hf"], tps["ours_fp32"] / tps["hf"]
    print(
        f"model deepseek_v2/{args.flavor}, batch {args.batch} × {args.seq_len}, "
        f"{torch.get_num_threads()} threads, median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(
        f"first-step loss: ours fp32 {losses['ours_fp32'][0]:.5f}, ours bf16 "
        f"{losses['ours_bf16'][0]:.5f}, transformers fp32 {losses['hf'][0]:.5f}"
    )
    print(
        f"measured matmul peak: bf16 {peak_bf16 * 1e3:.0f} GFLOP/s, fp32 {peak_fp32 * 1e3:.0f} GFLOP/s"
    )
    print(
        f"ours (bf16 compute):  {tps['ours_bf16']:7.1f} tok/s  step {times['ours_bf16']:.3f}s  "
        f"MFU {mfu:.1f}% of the bf16 peak"
    )
    print(
        f"ours (fp32):          {tps['ours_fp32']:7.1f} tok/s  step {times['ours_fp32']:.3f}s  "
        f"MFU {mfu32:.1f}% of the fp32 peak"
    )
    print(f"transformers (fp32):  {tps['hf']:7.1f} tok/s  step {times['hf']:.3f}s")
    print(f"transformers (fp32, default allocator, timed alone first): {hf_default_tps:7.1f} tok/s")
    print(
        f"ratio ours-bf16 / transformers-fp32 {ratio:.2f}; same dtype (fp32/fp32) {same_dtype:.2f}; "
        f"against the default-allocator run {tps['ours_bf16'] / hf_default_tps:.2f} / "
        f"{tps['ours_fp32'] / hf_default_tps:.2f}"
    )
    if not math.isclose(losses["ours_fp32"][0], losses["hf"][0], rel_tol=1e-3):
        print("WARNING: the first-step losses differ; the weight conversion may be wrong")
    print(
        json.dumps(
            {
                "ours_tps": round(tps["ours_bf16"], 1),
                "hf_tps": round(tps["hf"], 1),
                "ratio": round(ratio, 3),
                "mfu_pct": round(mfu, 2),
                "dtype": "ours bfloat16 compute (fp32 master weights), transformers float32",
                "ours_fp32_tps": round(tps["ours_fp32"], 1),
                "same_dtype_ratio": round(same_dtype, 3),
                "mfu_fp32_pct": round(mfu32, 2),
                "hf_default_tps": round(hf_default_tps, 1),
                "peak_gflops_bf16": round(peak_bf16 * 1e3),
                "peak_gflops_fp32": round(peak_fp32 * 1e3),
                "first_loss_ours_fp32": round(losses["ours_fp32"][0], 5),
                "first_loss_hf_fp32": round(losses["hf"][0], 5),
            }
        )
    )


if __name__ == "__main__":
    main()
