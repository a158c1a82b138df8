"""Kedro hook: object-storage credentials from ``conf/local/credentials.yml``.

The ``object_storage`` entry (``key``, ``secret``, ``token``, ``endpoint_url``,
``profile``, ``region``) becomes the AWS variables that s3fs reads, for this run and the
workers it starts, where the environment does not set them already
(``storage.credentials``). Only the variable names are logged.
"""

from __future__ import annotations

import logging
from typing import Any

from kedro.config import MissingConfigException
from kedro.framework.hooks import hook_impl

from titan_kedro.storage.credentials import CREDENTIALS_ENTRY, adopt_storage_credentials

logger = logging.getLogger(__name__)


class StorageCredentialsHook:
    """Adopts ``credentials.yml``'s ``object_storage`` entry as environment variables."""

    @hook_impl
    def after_context_created(self, context: Any) -> None:
        try:
            credentials = context.config_loader["credentials"]
        except MissingConfigException:
            return
        added = adopt_storage_credentials((credentials or {}).get(CREDENTIALS_ENTRY))
        if added:
            logger.info("object storage credentials from credentials.yml: %s", ", ".join(added))
