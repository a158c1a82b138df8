"""Hugging Face exports to the S3 test server, and a run's initial weights read from there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.storage_fixtures import S3Bucket
from tests.train.helpers import TINY_DEEPSEEK, tiny_job, write_token_dir
from titan_kedro.models.export_folder import MARKER, ExportFolderError
from titan_kedro.models.hf_export import export_hf_folder
from titan_kedro.models.resolve import resolve_job_config
from titan_kedro.storage.folders import CACHE_ENV
from titan_kedro.train.hf_init import load_hf_weights
from titan_kedro.train.trainer import build_model


def test_an_export_to_s3_is_marked_last_refuses_strangers_and_loads_back(
    s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    raw = tiny_job(
        tmp_path, write_token_dir(tmp_path / "tokens", n_train=2_000),
        model={"name": "deepseek_v2", "custom_model_path": None, "overrides": TINY_DEEPSEEK},
    )  # fmt: skip
    resolved = resolve_job_config(raw)
    source = build_model(resolved.spec, resolved.model_args, 123, torch.device("cpu"))
    target, fs = f"{s3_bucket.uri}/hf", s3_bucket.fs()
    fs.pipe_file(f"{s3_bucket.name}/hf/notes.txt", b"a user's file")
    with pytest.raises(ExportFolderError, match=r"notes\.txt"):
        export_hf_folder(source, resolved.spec, resolved.model_args, target)
    assert fs.cat_file(f"{s3_bucket.name}/hf/notes.txt") == b"a user's file"
    fs.rm_file(f"{s3_bucket.name}/hf/notes.txt")
    for _ in range(2):  # the second replaces the first (a previous export)
        files = export_hf_folder(source, resolved.spec, resolved.model_args, target)
    names = {str(f).rsplit("/", 1)[1] for f in files}
    assert {"config.json", "model.safetensors", MARKER} <= names
    fs.invalidate_cache()
    assert set(fs.ls(f"{s3_bucket.name}/hf", detail=False)) == {
        f"{s3_bucket.name}/hf/{n}" for n in names
    }
    fresh = build_model(resolved.spec, resolved.model_args, 7, torch.device("cpu"))
    load_hf_weights([fresh], resolved.spec, resolved.model_args, target)
    for (name, want), got in zip(
        source.state_dict().items(), fresh.state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name
