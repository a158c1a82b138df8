"""``ShardFileDataset``: one raw C4 shard, loaded as a file handle for our own robust reader."""

from __future__ import annotations

from typing import Any

from kedro.io import AbstractDataset, DatasetError

from titan_kedro.data.sources import ShardFile
from titan_kedro.storage import as_path


class ShardFileDataset(AbstractDataset[None, ShardFile]):
    """Loads a shard as a ``ShardFile`` (path, size, mtime) instead of parsing it.

    Meant as the underlying dataset of a ``partitions.PartitionedDataset``: the partitioned
    dataset hands the node one lazy loader per file, and the node streams each file through
    ``titan_kedro.data.c4_reader`` (which survives truncated gzip and bad lines). Read-only.

    Example:
        >>> from titan_kedro.datasets.shard_file_dataset import ShardFileDataset
        >>> path = tmp_path / "c4-train.00000-of-01024.json"
        >>> _ = path.write_text('{"text": "hello"}\\n')
        >>> shard = ShardFileDataset(filepath=str(path)).load()
        >>> shard.name, shard.size
        ('c4-train.00000-of-01024.json', 18)
    """

    def __init__(self, *, filepath: str, metadata: dict[str, Any] | None = None) -> None:
        """Create a dataset for one shard.

        Args:
            filepath: Path of the shard file, or its object-storage URI (``s3://…``).
            metadata: Free-form metadata (kedro-viz layer, …), ignored by Kedro.
        """
        self._filepath = as_path(filepath, "a C4 shard")
        self.metadata = metadata

    def load(self) -> ShardFile:
        if not self._filepath.is_file():
            raise DatasetError(f"shard {self._filepath} does not exist")
        return ShardFile.from_path(self._filepath)

    def save(self, data: None) -> None:
        raise DatasetError(f"{type(self).__name__} is read-only; raw shards are never written")

    def _exists(self) -> bool:
        return self._filepath.is_file()

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath)}
