"""Packing and splitting invariants."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import write_c4_shard
from data_helpers import offline_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from titan_kedro.data.packing import PackedSplit, pack_documents, plan_split
from titan_kedro.data.shard_store import ShardStore
from titan_kedro.data.shard_tokenizing import tokenize_sources
from titan_kedro.data.sources import ShardFile
from titan_kedro.data.splitting import text_hash, validation_mask

BOS, EOS = 7, 9

docs_strategy = st.lists(st.lists(st.integers(10, 2**32 - 1), min_size=1, max_size=12), max_size=20)


@settings(max_examples=200, deadline=None)
@given(docs=docs_strategy, data=st.data())
def test_pack_is_bos_doc_eos_for_each_kept_document(
    docs: list[list[int]], data: st.DataObject
) -> None:
    keep = np.array(
        data.draw(st.lists(st.booleans(), min_size=len(docs), max_size=len(docs))), dtype=bool
    )
    tokens = np.array([t for d in docs for t in d], dtype=np.uint32)
    lengths = np.array([len(d) for d in docs], dtype=np.uint32)
    packed = pack_documents(tokens, lengths, keep, bos_id=BOS, eos_id=EOS)
    expected = [t for d, k in zip(docs, keep, strict=True) if k for t in (BOS, *d, EOS)]
    assert packed.dtype == np.dtype("<u4")
    assert packed.tolist() == expected
    assert int((packed == BOS).sum()) == int(keep.sum()) == int((packed == EOS).sum())
    assert len(packed) == int(lengths[keep].sum()) + 2 * int(keep.sum())
    everything = pack_documents(tokens, lengths, None, bos_id=BOS, eos_id=EOS)
    assert everything.tolist() == [t for d in docs for t in (BOS, *d, EOS)]


def test_validation_mask_is_stable_and_proportional() -> None:
    texts = [f"document number {i}" for i in range(4000)]
    hashes = np.array([text_hash(t) for t in texts], dtype=np.uint64)
    mask = validation_mask(hashes, 0.1)
    assert 0.08 < mask.mean() < 0.12
    assert np.array_equal(mask, validation_mask(hashes[::-1], 0.1)[::-1])  # order-free
    assert not validation_mask(hashes, 0.0).any()
    assert text_hash("same text") == text_hash("same text")
    with pytest.raises(ValueError, match="validation_fraction"):
        validation_mask(hashes, 1.0)


def test_split_has_no_document_in_both_and_chunks_match_one_shot_packing(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    write_c4_shard(raw / "c4-train.00000.json.gz", 60, seed=0)
    write_c4_shard(raw / "c4-train.00001.json.gz", 60, seed=0)  # the same texts again
    store = ShardStore(tmp_path / "inter")
    tok = offline_tokenizer()
    entries = tokenize_sources(
        [ShardFile.from_path(p) for p in sorted(raw.iterdir())], tok, store, num_workers=1
    )
    plan = plan_split(store, entries, 0.3)
    assert plan["splits"]["train"]["documents"] + plan["splits"]["validation"]["documents"] == 120
    # Duplicates land in the same split: both shards split identically.
    assert plan["shards"][0]["train"] == plan["shards"][1]["train"]

    streams = {}
    for split in ("train", "validation"):
        chunked = PackedSplit(
            store.root,
            entries,
            split,
            validation_fraction=0.3,
            bos_id=tok.bos_id,
            eos_id=tok.eos_id,
            chunk_tokens=97,
        )
        chunks = list(chunked)
        assert len(chunks) > 2
        whole = np.concatenate(chunks)
        assert len(whole) == plan["splits"][split]["tokens"]
        assert whole[0] == tok.bos_id and whole[-1] == tok.eos_id
        assert np.array_equal(whole, np.concatenate(list(chunked)))  # re-iterable
        streams[split] = whole

    def documents(stream: np.ndarray) -> set[str]:
        bounds = np.flatnonzero(stream == tok.bos_id)
        ends = np.flatnonzero(stream == tok.eos_id)
        return {tok.decode(stream[b + 1 : e].tolist()) for b, e in zip(bounds, ends, strict=True)}

    train, validation = documents(streams["train"]), documents(streams["validation"])
    assert train and validation and not train & validation


def test_empty_train_split_is_an_error(tmp_path: Path) -> None:
    store = ShardStore(tmp_path / "inter")
    with pytest.raises(ValueError, match="train split is empty"):
        plan_split(store, [], 0.1)
