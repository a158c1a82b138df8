"""Tokenization throughput: our whole tokenize → pack → write path vs raw ``tokenizers``.

Both run in one process on the same documents (the C4 sample beside the repository,
repeated ``--repeat-docs`` times, else generated text), interleaved ``--repeats`` times;
medians are reported. The baseline is ``tokenizers.Tokenizer.encode_batch`` on one thread
(``TOKENIZERS_PARALLELISM=false`` for that call), with no BOS/EOS and no file I/O.

    .venv/bin/python benchmarks/tokenize_throughput.py --workers 1
    .venv/bin/python benchmarks/tokenize_throughput.py --workers 2 --also-threads

The last line printed is one JSON object with ``ours_tps``, ``raw_tps`` and ``ratio``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO.parent / "shared" / "data" / "c4" / "c4-train.00000-of-01024.head900.json.gz"


def load_documents(repeat: int) -> tuple[list[str], str]:
    """The sample's texts ``repeat`` times (else 900 generated documents per repeat)."""
    if SAMPLE.exists():
        with gzip.open(SAMPLE, "rt", encoding="utf-8") as fh:
            docs = [json.loads(line)["text"] for line in fh]
        origin = f"C4 sample ({len(docs)} documents) x {repeat}"
    else:
        rng = random.Random(0)
        words = "the of and to in a is that for it as was with data model river music".split()
        docs = [
            " ".join(" ".join(rng.choices(words, k=15)).capitalize() + "." for _ in range(30))
            for _ in range(900)
        ]
        origin = f"generated text ({len(docs)} documents) x {repeat}"
    return docs * repeat, origin


@contextlib.contextmanager
def env(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the joined pool workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def timed(fn: Callable[[], int]) -> tuple[float, float]:
    """Tokens per wall-clock second and per CPU second of one call of ``fn``."""
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    tokens = fn()
    return tokens / (time.perf_counter() - start), tokens / (_cpu_seconds() - cpu_start)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1, help="data.num_workers for our path")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (median)")
    parser.add_argument("--repeat-docs", type=int, default=8, help="copies of the sample")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument(
        "--also-threads",
        action="store_true",
        help="also time raw encode_batch and our path on the Rust thread pool (one process)",
    )
    args = parser.parse_args(argv)

    from titan_kedro.data.batch_encoding import BatchEncoder
    from titan_kedro.data.packing import PackedSplit
    from titan_kedro.data.shard_store import ShardStore
    from titan_kedro.data.shard_tokenizing import tokenize_sources
    from titan_kedro.data.sources import ShardFile
    from titan_kedro.data.tokenizer import build_tokenizer
    from titan_kedro.datasets.token_files_dataset import TokenFilesDataset

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    docs, origin = load_documents(args.repeat_docs)
    tok = build_tokenizer("deepseek-ai/DeepSeek-V2-Lite")
    raw = tok.backend  # the plain tokenizers.Tokenizer (special-token parsing off, as ours)
    work = Path(tempfile.mkdtemp(prefix="tokenize-bench-"))
    shard = work / "c4-bench.json.gz"
    with gzip.open(shard, "wt", encoding="utf-8") as fh:
        for text in docs:
            fh.write(json.dumps({"text": text, "url": "", "timestamp": ""}) + "\n")
    runs = 0

    def ours(parallel: str = "processes") -> int:
        nonlocal runs
        runs += 1
        root = work / f"run{runs}"
        store = ShardStore(root / "intermediate")
        entries = tokenize_sources(
            [ShardFile.from_path(shard)],
            tok,
            store,
            batch_size=args.batch_size,
            num_workers=args.workers,
            parallel=parallel,
        )
        splits = {
            s: PackedSplit(
                store.root,
                entries,
                s,
                validation_fraction=0.05,
                bos_id=tok.bos_id,
                eos_id=tok.eos_id,
            )
            for s in ("train", "validation")
        }
        TokenFilesDataset(path=str(root / "tokens")).save({"splits": splits, "metadata": {}})
        # Count document tokens only (not BOS/EOS), the same quantity as the baseline.
        return sum(e["tokens"] for e in entries)

    def raw_batch(parallel: bool) -> int:
        with env("TOKENIZERS_PARALLELISM", "true" if parallel else "false"):
            encodings = raw.encode_batch(docs, add_special_tokens=False)
        return sum(len(e.ids) for e in encodings)

    tokens = raw_batch(False)
    print(
        f"documents: {len(docs)} ({origin}), {tokens:,} tokens, {os.cpu_count()} CPU cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    results: dict[str, list[tuple[float, float]]] = {
        "raw": [],
        "ours": [],
        "raw_threads": [],
        "ours_threads": [],
    }
    for _ in range(args.repeats):
        results["raw"].append(timed(lambda: raw_batch(False)))
        results["ours"].append(timed(ours))
        if args.also_threads:
            results["raw_threads"].append(timed(lambda: raw_batch(True)))
            results["ours_threads"].append(timed(lambda: ours("threads")))
    cpu: dict[str, float] = {}

    def report(label: str, key: str) -> float:
        walls = [wall for wall, _ in results[key]]
        median = statistics.median(walls)
        cpu[key] = statistics.median(c for _, c in results[key])
        runs_text = ", ".join(f"{v:,.0f}" for v in walls)
        print(
            f"{label}: {median:,.0f} tokens/s (median of {runs_text}); "
            f"{cpu[key]:,.0f} tokens per CPU second"
        )
        return median

    raw_tps = report("raw tokenizers encode_batch, 1 thread (TOKENIZERS_PARALLELISM=false)", "raw")
    ours_tps = report(
        f"ours: read+clean+tokenize+hash+split+pack+write, {args.workers} worker(s)"
        + (
            f" (this process + {args.workers - 1} spawned helper(s), 1 thread each)"
            if args.workers > 1
            else " (in-process, 1 thread)"
        ),
        "ours",
    )
    summary: dict[str, float | int | str] = {
        "ours_tps": round(ours_tps),
        "raw_tps": round(raw_tps),
        "ratio": round(ours_tps / raw_tps, 3),
        "workers": args.workers,
        "baseline": "encode_batch, single thread (TOKENIZERS_PARALLELISM=false)",
        "tokens": tokens,
        "cpu_ratio": round(cpu["ours"] / cpu["raw"], 3),
        "loadavg_1min": round(os.getloadavg()[0], 2),
    }
    if args.workers > 1:
        start = time.perf_counter()
        with BatchEncoder(tok, args.workers) as encoder:
            list(encoder.map([["warm up"]] * args.workers))
        summary["pool_start_stop_s"] = round(time.perf_counter() - start, 2)
        print(
            f"of which fixed cost per run: starting and stopping {args.workers - 1} helper process(es) "
            f"takes {summary['pool_start_stop_s']} s"
        )
    if args.also_threads:
        threads = report("raw encode_batch on the Rust thread pool (all cores)", "raw_threads")
        ours_threads = report(
            f"ours on the Rust thread pool, {args.workers} lane(s)", "ours_threads"
        )
        summary["raw_threads_tps"] = round(threads)
        summary["ours_threads_tps"] = round(ours_threads)
    print(json.dumps(summary))
    return summary  # type: ignore[return-value]


if __name__ == "__main__":
    main(sys.argv[1:])
