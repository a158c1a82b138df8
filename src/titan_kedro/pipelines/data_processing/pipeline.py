"""The ``data_processing`` pipeline: raw C4 → packed token files and their metadata."""

from __future__ import annotations

from kedro.pipeline import Pipeline, node

from titan_kedro.pipelines.data_processing.nodes import (
    clean_documents,
    pack_documents,
    save_token_metadata,
    split_documents,
    tokenize_documents,
)


def create_pipeline(**kwargs: object) -> Pipeline:
    """clean → tokenize → split → pack → save; ends in ``token_files`` and ``token_metadata``."""
    return Pipeline(
        [
            node(
                clean_documents, ["c4_raw", "params:data"], "c4_documents", name="clean_documents"
            ),
            node(
                tokenize_documents,
                ["c4_documents", "params:data", "params:tokenizer"],
                "c4_token_shards",
                name="tokenize_documents",
            ),
            node(
                split_documents,
                ["c4_token_shards", "params:data"],
                "c4_split",
                name="split_documents",
            ),
            node(
                pack_documents,
                ["c4_token_shards", "c4_split"],
                "token_files",
                name="pack_documents",
            ),
            node(
                save_token_metadata,
                ["token_files", "params:data"],
                "token_metadata",
                name="save_token_metadata",
            ),
        ],
        tags=["data_processing"],
    )
