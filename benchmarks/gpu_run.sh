#!/usr/bin/env bash
# Training throughput on one CUDA GPU: DeepSeek-V2-Lite with its layer count reduced to fit,
# sequence length 4096, bf16 mixed precision (FSDP2), 20 steps; prints tokens/s and MFU.
#
#   benchmarks/gpu_run.sh                       # 6 layers, batch 1 × 4096
#   N_LAYERS=8 BATCH=2 STEPS=30 COMPILE=true AC=selective benchmarks/gpu_run.sh
#
# Random token ids stand in for data (throughput does not depend on the text), so no
# data pipeline or network is needed. Every figure comes from the worker's metrics.jsonl;
# MFU is against the GPU's dense bf16 peak (titan_kedro.train.metrics.GPU_PEAK_BF16_TFLOPS,
# e.g. 989 TFLOP/s for H100/H200). Without CUDA the script stops with an error.
#
# Then (FT=true, the default) fault-tolerant replica groups on CUDA: their collectives go
# through NCCL, which refuses CPU tensors (TorchFT's Manager turns that into steps that are
# never committed). One GPU holds one NCCL rank per communicator ("Duplicate GPU
# detected"), so on one GPU a group runs alone in its quorum over TorchFT's real
# ProcessGroupNCCL and Manager (tests/ft/test_replica_device.py, its cuda case).
set -euo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, not an install's
PYTHON="${PYTHON:-.venv/bin/python}"
N_LAYERS="${N_LAYERS:-6}"
SEQ_LEN="${SEQ_LEN:-4096}"
BATCH="${BATCH:-1}"
STEPS="${STEPS:-20}"
WARMUP="${WARMUP:-5}"          # steps left out of the averages (allocator, autotuning)
COMPILE="${COMPILE:-false}"
AC="${AC:-none}"               # activation checkpointing: none | selective | full
FT="${FT:-true}"               # also check the replica groups' collectives on NCCL
OUT="${OUT:-$(mktemp -d -t titan-gpu-run-XXXXXX)}"

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "error: benchmarks/gpu_run.sh needs a CUDA GPU, but torch.cuda.is_available() is False" >&2
    echo "       (torch $("$PYTHON" -c 'import torch; print(torch.__version__)')); run it on a GPU machine" >&2
    exit 1
fi
if [ "$STEPS" -le "$WARMUP" ]; then
    echo "error: STEPS=$STEPS must be larger than WARMUP=$WARMUP" >&2
    exit 1
fi

echo "gpu: $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0))')"
echo "output: $OUT"

"$PYTHON" - "$OUT/tokens" "$BATCH" "$SEQ_LEN" "$STEPS" <<'PY'
import sys
from pathlib import Path

import numpy as np

folder, batch, seq_len, steps = Path(sys.argv[1]), *map(int, sys.argv[2:])
folder.mkdir(parents=True, exist_ok=True)
n_tokens = 2 * batch * (seq_len + 1) * (steps + 2)
rng = np.random.default_rng(0)
for split in ("train", "validation"):
    rng.integers(0, 102400, n_tokens, dtype=np.uint32).astype("<u4").tofile(folder / f"{split}.bin")
PY

# The plan of this very job (one fake step on the CPU, CUDA attention substituted), to check
# against what the GPU allocates (torch.cuda.max_memory_allocated, logged by the worker).
PLANNED_GIB="$("$PYTHON" - "$N_LAYERS" "$SEQ_LEN" "$BATCH" "$AC" <<'PY'
import sys

from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.plan import build_plan

n_layers, seq_len, batch, ac = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
raw = {
    "model": {"name": "deepseek_v2", "flavor": "v2-lite", "overrides": {"n_layers": n_layers}},
    "training": {"device": "cuda", "seq_len": seq_len, "local_batch_size": batch,
                 "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32",
                 "activation_checkpoint": ac},
}
plan = build_plan(resolve_job_config(raw))
print(f"{plan['gib_per_rank']['total']:.3f}")
PY
)"
echo "planned peak (fake step): $PLANNED_GIB GiB"

"$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=1 \
    -m titan_kedro.train \
    --job.name gpu-run --job.dump_folder "$OUT/job" \
    --data.token_dir "$OUT/tokens" \
    --model.name deepseek_v2 --model.flavor v2-lite --model.overrides "{n_layers: $N_LAYERS}" \
    --training.device cuda --training.steps "$STEPS" --training.seq_len "$SEQ_LEN" \
    --training.local_batch_size "$BATCH" --training.mixed_precision_param bfloat16 \
    --training.mixed_precision_reduce float32 --training.compile "$COMPILE" \
    --training.activation_checkpoint "$AC" \
    --lr_scheduler.warmup_steps 2 \
    --launch.nproc_per_node 1 --launch.nnodes 1 \
    --checkpoint.enable false --checkpoint.resume never --checkpoint.folder "$OUT/ckpt" \
    --metrics.log_freq 1 --metrics.enable_mlflow false \
    --validation.freq 0

"$PYTHON" - "$OUT/job/metrics.jsonl" "$WARMUP" "$N_LAYERS" "$SEQ_LEN" "$BATCH" "$PLANNED_GIB" <<'PY'
import json
import statistics
import sys

path, warmup, n_layers, seq_len, batch = sys.argv[1], *map(int, sys.argv[2:6])
planned = float(sys.argv[6])
rows = [json.loads(line) for line in open(path) if line.strip()]
timed = [r for r in rows if r["step"] > warmup]
if not timed:
    sys.exit(f"error: no steps after the first {warmup} in {path}")
tps = statistics.mean(r["tps"] for r in timed)
mfu = statistics.mean(r["mfu_pct"] for r in timed)
tflops = statistics.mean(r["tflops"] for r in timed)
mem = max(r["memory_gib"] for r in timed)
allocated = max(r["memory_allocated_gib"] for r in timed)
print(
    f"v2-lite ({n_layers} layers), batch {batch} × {seq_len}, bf16: {tps:,.0f} tokens/s per GPU, "
    f"{tflops:.1f} TFLOP/s, MFU {mfu:.1f}%, peak reserved {mem:.1f} GiB "
    f"(mean of steps {warmup + 1}-{rows[-1]['step']})"
)
print(f"planned peak {planned:.2f} GiB vs torch.cuda.max_memory_allocated {allocated:.2f} GiB "
      f"(planned / real {planned / allocated:.3f})")
print(json.dumps({"tps": round(tps, 1), "planned_gib": planned, "allocated_gib": round(allocated, 3), "mfu_pct": round(mfu, 2), "tflops": round(tflops, 2),
                  "memory_gib": round(mem, 2), "n_layers": n_layers, "seq_len": seq_len,
                  "batch": batch}))
PY

if [ "$FT" = true ]; then
    echo "fault tolerance: replica-group collectives on NCCL (one group, TorchFT Manager)"
    TITAN_TEST_FT_DEVICES=cuda "$PYTHON" -m pytest -q -p no:cacheprovider "tests/ft/test_replica_device.py"
fi
