"""TokenLoader at corpus scale: start-up time, peak RSS and batches/s for 20M vs 20B tokens.

Each case runs in a fresh process over a sparse ``uint32`` token file (``truncate`` to
size: no disk is used, reads return zeros), as one of ``--dp`` ranks. Two loaders:

- ``ours``: ``titan_kedro.data.loader.TokenLoader`` (on-the-fly window permutation);
- ``baseline``: the previous design in the same process setup — an int64 permutation of
  every window per epoch (``np.random.default_rng([seed, epoch]).permutation(n)``), this
  rank's ``[rank::dp]`` slice kept.

Start-up is construction plus the first batch; RSS is the process's peak
(``ru_maxrss``, which includes the token file's pages mapped in by reads) and its
anonymous RSS (``RssAnon``: what the loader itself allocates) after ``--batches`` batches. Training's need is stated as the tokens/s one
H100 consumes training Llama 3 8B at 40 % MFU (989 TFLOP/s × 0.4 / 6·8.03e9 FLOPs per
token ≈ 8.2k tokens/s); the ratio printed is the loader's tokens/s over that.

    .venv/bin/python benchmarks/loader_scale.py       # seq_len 256, batch 8, 8 ranks

The last line is one JSON object with every case and the ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

NEED_TOKENS_PER_S = 989e12 * 0.4 / (6 * 8.03e9)
"""Tokens/s one H100 consumes for Llama 3 8B at 40 % MFU."""


def _case(path: str, loader: str, *, seq_len: int, batch: int, dp: int, batches: int) -> dict:
    import torch  # noqa: F401  (same imports in both cases)

    tokens = np.memmap(path, dtype="<u4", mode="r")
    start = time.perf_counter()
    if loader == "ours":
        from titan_kedro.data.loader import TokenLoader

        it = TokenLoader(
            tokens, seq_len=seq_len, local_batch_size=batch, data_rank=dp - 1, data_ranks=dp, seed=0
        )
        next_batch = it.__next__
    else:
        n = (len(tokens) - 1) // seq_len
        order = np.random.default_rng([0, 0]).permutation(n)[dp - 1 :: dp]
        offsets = np.arange(seq_len + 1)
        position = [0]

        def next_batch() -> Any:
            windows = order[position[0] : position[0] + batch]
            position[0] += batch
            return np.asarray(tokens[(windows * seq_len)[:, None] + offsets], dtype=np.int64)

    next_batch()
    startup = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(batches):
        next_batch()
    rate = batches / (time.perf_counter() - start)
    return {
        "startup_s": startup,
        "batches_per_s": rate,
        "tokens_per_s": rate * batch * seq_len,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "anon_rss_mib": _anon_rss_mib(),
    }


def _anon_rss_mib() -> float:
    """Anonymous resident memory (what the loader allocates; not the token file's cached pages)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--case", nargs=2, metavar=("FILE", "LOADER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(
            json.dumps(
                _case(
                    *args.case,
                    seq_len=args.seq_len,
                    batch=args.batch,
                    dp=args.dp,
                    batches=args.batches,
                )
            )
        )
        return
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, n_tokens in (("20M", 20_000_000), ("20B", 20_000_000_000)):
            path = Path(tmp) / f"{label}.bin"
            with path.open("wb") as handle:
                handle.truncate(4 * n_tokens)
            for loader in ("ours", "baseline"):
                cmd = [sys.executable, __file__, "--case", str(path), loader]
                cmd += ["--seq-len", str(args.seq_len), "--batch", str(args.batch)]
                cmd += ["--dp", str(args.dp), "--batches", str(args.batches)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                results[f"{loader}_{label}"] = row = json.loads(out.splitlines()[-1])
                print(
                    f"{loader:8s} {label}: start-up {row['startup_s'] * 1e3:8.1f} ms, peak RSS "
                    f"{row['peak_rss_mib']:7.0f} MiB (anon {row['anon_rss_mib']:6.0f}), {row['batches_per_s']:8.0f} batches/s "
                    f"({row['tokens_per_s'] / 1e6:.1f}M tokens/s)",
                    flush=True,
                )
    ours_20m, ours_20b = results["ours_20M"], results["ours_20B"]
    summary = {
        **results,
        "ours_rss_20B_over_20M": ours_20b["peak_rss_mib"] / ours_20m["peak_rss_mib"],
        "ours_anon_rss_20B_over_20M": ours_20b["anon_rss_mib"] / ours_20m["anon_rss_mib"],
        "ours_startup_20B_over_20M": ours_20b["startup_s"] / ours_20m["startup_s"],
        "baseline_rss_20B_over_ours_20B": results["baseline_20B"]["peak_rss_mib"]
        / ours_20b["peak_rss_mib"],
        "baseline_startup_20B_over_ours_20B": results["baseline_20B"]["startup_s"]
        / ours_20b["startup_s"],
        "ours_20B_tokens_per_s_over_need": ours_20b["tokens_per_s"] / NEED_TOKENS_PER_S,
        "need_tokens_per_s": NEED_TOKENS_PER_S,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
