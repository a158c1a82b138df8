"""Raw C4 shards on the S3 test server: listed by the catalog's dataset, read like local ones."""

from __future__ import annotations

import pickle
from pathlib import Path

from kedro_datasets.partitions import PartitionedDataset

from tests.conftest import write_c4_shard
from tests.storage_fixtures import S3Bucket
from titan_kedro.data.bad_input import SkipReport
from titan_kedro.data.sources import ShardFile


def _texts(shard: ShardFile) -> list[str]:
    return [d.text for d in shard.documents(SkipReport(shard.name), min_chars=1)]


def test_shards_under_an_s3_prefix_read_like_the_local_files(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    local = write_c4_shard(tmp_path / "c4" / "c4-train.00000-of-01024.json.gz", 60)
    s3_bucket.fs().put_file(str(local), f"{s3_bucket.name}/c4/{local.name}")
    partitions = PartitionedDataset(  # what conf/base's c4_raw becomes with an s3:// raw_dir
        path=f"{s3_bucket.uri}/c4",
        dataset="titan_kedro.datasets.shard_file_dataset.ShardFileDataset",
    ).load()
    assert list(partitions) == [local.name]
    remote = next(iter(partitions.values()))()
    shard = pickle.loads(pickle.dumps(remote))  # as the process pool gets it
    assert str(shard.path) == f"{s3_bucket.uri}/c4/{local.name}"
    here = ShardFile.from_path(local)
    assert shard.size == here.size and shard.name == here.name
    assert _texts(shard) == _texts(here) and len(_texts(here)) == 60
    assert shard.describe()["sha256"] == here.describe()["sha256"]
