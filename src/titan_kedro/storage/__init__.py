"""Where data and checkpoints live: local paths and object-storage URIs, one way in.

Rooms: ``paths`` (a location as a path object: ``pathlib.Path`` for local paths, a
``UPath`` over fsspec for ``s3://`` and other URIs; refuses credentials in a URI) and
``objects`` (what object storage lacks and POSIX has: exclusive create, compare-and-swap
replace, removing a prefix). This package imports nothing else of titan_kedro, so
``data/``, ``runs/``, ``train/``, ``models/`` and ``launch/`` all build on it.

Credentials are never part of a location: fsspec's backends find them the usual way
(``s3fs``/botocore: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``,
``AWS_ENDPOINT_URL_S3`` for an S3-compatible server, instance roles).
"""

from titan_kedro.storage.paths import (
    StoragePath,
    as_path,
    is_remote,
    local_path,
)

__all__ = ["StoragePath", "as_path", "is_remote", "local_path"]
