"""Peak memory of tokenize → pack → save does not grow with the corpus (measured in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: write a shard of N documents, then trace Python allocations
# (numpy buffers included) while it is tokenized, split, packed and written.
_SCRIPT = """
import gzip, json, sys, tracemalloc
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from conftest import write_c4_shard
from titan_kedro.data.packing import PackedSplit
from titan_kedro.data.shard_store import ShardStore
from titan_kedro.data.shard_tokenizing import tokenize_sources
from titan_kedro.data.sources import ShardFile
from titan_kedro.data.tokenizer import build_tokenizer
from titan_kedro.datasets.token_files_dataset import TokenFilesDataset

n_docs, root = int(sys.argv[1]), Path(sys.argv[2])
shard = write_c4_shard(root / "raw" / "c4-train.00000.json.gz", n_docs)
text_bytes = sum(len(json.loads(l)["text"].encode()) for l in gzip.open(shard, "rt"))
tok = build_tokenizer("deepseek-ai/DeepSeek-V2-Lite")
tok.encode("warm up", bos=False, eos=False)
tracemalloc.start()
store = ShardStore(root / "inter")
entries = tokenize_sources([ShardFile.from_path(shard)], tok, store, batch_size=32, num_workers=1)
splits = {s: PackedSplit(store.root, entries, s, validation_fraction=0.1, bos_id=tok.bos_id,
                         eos_id=tok.eos_id, chunk_tokens=8192) for s in ("train", "validation")}
TokenFilesDataset(path=str(root / "tokens")).save({"splits": splits, "metadata": {}})
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"peak": peak, "tokens": entries[0]["tokens"], "text_bytes": text_bytes}))
"""


def _peak(n_docs: int, root: Path) -> dict[str, int]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(n_docs), str(root), str(TESTS)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_memory_does_not_double_when_the_input_doubles(tmp_path: Path) -> None:
    small = _peak(1000, tmp_path / "small")
    large = _peak(2000, tmp_path / "large")
    assert large["tokens"] > 1.9 * small["tokens"]
    assert large["peak"] < 1.3 * small["peak"], (small, large)
    # The peak is below the size of the input text and of its tokens: neither is ever held whole.
    assert large["peak"] < min(large["text_bytes"], 4 * large["tokens"]), large
