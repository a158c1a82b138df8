"""Object storage against local disk, in one run: the token loader and checkpoint save/load.

    python benchmarks/storage.py                          # a SeaweedFS server on 127.0.0.1
    python benchmarks/storage.py --s3-uri s3://bucket/x   # a real bucket (credentials from
                                                          # the environment / AWS profile)

Prints, for the same token file and the same model state:

- the loader's tokens/s from local disk (memory map), from S3 through the node-local cache
  (``data.remote_tokens.cached_copy``: the one-off download, then the cached file) and from
  S3 by ranged reads (``RangedTokens``), with ratios to local disk;
- ``CheckpointManager`` save and load time (one gloo rank; DCP, metadata, publish) into a
  local folder and into S3, with ratios.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster import s3_up  # noqa: E402
from titan_kedro.data.loader import TokenLoader  # noqa: E402
from titan_kedro.data.remote_tokens import RangedTokens, cached_copy  # noqa: E402
from titan_kedro.data.token_store import open_split  # noqa: E402
from titan_kedro.train.checkpoint import CheckpointManager, ModelState  # noqa: E402


def loader_rate(tokens: object, *, seq_len: int, batch: int, steps: int) -> float:
    """Tokens per second the loader yields over ``steps`` batches (after one warm-up)."""
    loader = TokenLoader(
        tokens,
        seq_len=seq_len,
        local_batch_size=batch,
        data_rank=0,
        data_ranks=1,
        seed=0,  # type: ignore[arg-type]
    )
    next(loader)
    start = time.perf_counter()
    for _ in range(steps):
        next(loader)
    return steps * batch * seq_len / (time.perf_counter() - start)


def checkpoint_times(folder: str, model: nn.Module) -> tuple[float, float]:
    """Seconds to save and to load one checkpoint of ``model`` in ``folder``."""
    manager = CheckpointManager(
        folder,
        {"model": ModelState([model])},
        per_rank_state=lambda: {},
        restore_per_rank=lambda entry, same_world=True: None,
        keep_latest_k=1,
    )
    start = time.perf_counter()
    path = manager.save(1)
    saved = time.perf_counter() - start
    start = time.perf_counter()
    manager.load(path)
    return saved, time.perf_counter() - start


def main() -> int:
    """Run both comparisons and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--s3-uri", help="an s3:// prefix to use instead of a local server")
    parser.add_argument("--tokens-mib", type=int, default=64, help="token file size")
    parser.add_argument("--model-mib", type=int, default=64, help="checkpointed state size")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="titan-storage-bench-"))
    os.environ["TITAN_KEDRO_CACHE_DIR"] = str(work / "cache")
    state = None
    if args.s3_uri:
        prefix = args.s3_uri.rstrip("/")
    else:
        state = work / "server"
        env = s3_up.start(state)
        os.environ.update(
            AWS_ACCESS_KEY_ID=env["TITAN_TEST_S3_KEY"],
            AWS_SECRET_ACCESS_KEY=env["TITAN_TEST_S3_SECRET"],
            AWS_ENDPOINT_URL_S3=env["TITAN_TEST_S3_ENDPOINT"],
            AWS_DEFAULT_REGION="us-east-1",
        )
        import fsspec

        bucket = f"bench-{secrets.token_hex(4)}"
        fsspec.filesystem("s3").mkdir(bucket)
        prefix = f"s3://{bucket}"
    try:
        return _run(args, work, prefix)
    finally:
        if state is not None:
            s3_up.stop(state)


def _run(args: argparse.Namespace, work: Path, prefix: str) -> int:
    import fsspec

    n = args.tokens_mib * 2**20 // 4
    tokens = np.random.default_rng(0).integers(0, 100_000, n, dtype=np.uint32)
    (work / "tokens").mkdir()
    tokens.tofile(work / "tokens" / "train.bin")
    remote = f"{prefix}/tokens"
    fsspec.filesystem("s3").put_file(str(work / "tokens" / "train.bin"), f"{remote}/train.bin")
    shape = {"seq_len": args.seq_len, "batch": args.batch, "steps": args.steps}
    local_rate = loader_rate(open_split(work / "tokens", "train"), **shape)
    start = time.perf_counter()
    cached_copy(f"{remote}/train.bin")
    download_s = time.perf_counter() - start
    cached_rate = loader_rate(open_split(remote, "train"), **shape)
    ranged_rate = loader_rate(RangedTokens(f"{remote}/train.bin"), **shape)

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(work / "store"), 1), rank=0, world_size=1
    )
    width = 1024
    layers = max(1, args.model_mib * 2**20 // (4 * width * width))
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    local_save, local_load = checkpoint_times(str(work / "ckpt"), model)
    s3_save, s3_load = checkpoint_times(f"{prefix}/ckpt", model)
    dist.destroy_process_group()

    where = prefix if args.s3_uri else f"SeaweedFS on 127.0.0.1 ({prefix})"
    print(f"object storage: {where}")
    print(f"token file: {n:,} tokens ({args.tokens_mib} MiB); batches {args.batch} × "
          f"{args.seq_len}, {args.steps} steps")  # fmt: skip
    print(f"{'loader':<36}{'tokens/s':>14}{'vs local':>10}")
    for name, rate in (
        ("local disk (memmap)", local_rate),
        ("S3, node-local cache (after copy)", cached_rate),
        ("S3, ranged reads", ranged_rate),
    ):
        print(f"{name:<36}{rate:>14,.0f}{rate / local_rate:>10.3f}")
    print(f"one-off copy into the node cache: {download_s:.2f} s "
          f"({args.tokens_mib / download_s:.0f} MiB/s)")  # fmt: skip
    mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    print(f"checkpoint: {mib:.0f} MiB of parameters, one rank")
    print(f"{'checkpoint':<12}{'local s':>10}{'S3 s':>10}{'S3 / local':>12}")
    print(f"{'save':<12}{local_save:>10.2f}{s3_save:>10.2f}{s3_save / local_save:>12.2f}")
    print(f"{'load':<12}{local_load:>10.2f}{s3_load:>10.2f}{s3_load / local_load:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
