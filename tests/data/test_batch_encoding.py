"""BatchEncoder: the main process and helper processes together keep batches in order."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import c4_documents
from data_helpers import offline_tokenizer

from titan_kedro.data.batch_encoding import BatchEncoder, encode_texts
from titan_kedro.data.splitting import text_hash


@pytest.mark.slow
def test_three_lanes_return_the_same_batches_in_order() -> None:
    tok = offline_tokenizer()
    docs = c4_documents(120)
    batches = [docs[i : i + 3] for i in range(0, len(docs), 3)]  # 40 small batches
    with BatchEncoder(tok, 3) as encoder:
        assert encoder.workers == 3
        results = list(encoder.map(batches))
    assert len(results) == len(batches)
    for texts, got in zip(batches, results, strict=True):
        want = encode_texts(tok.backend, texts)
        assert np.array_equal(got.ids, want.ids)
        assert np.array_equal(got.lengths, want.lengths)
        assert got.hashes.tolist() == [text_hash(t) for t in texts]
    ids = np.concatenate([r.ids for r in results])
    expected = [i for d in docs for i in tok.encode(d, bos=False, eos=False)]
    assert ids.tolist() == expected


def test_unknown_parallel_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="processes' or 'threads'"):
        BatchEncoder(offline_tokenizer(), 1, parallel="gpu")
