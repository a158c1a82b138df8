"""Reaching the Hugging Face hub without hanging when there is no network."""

from __future__ import annotations

import logging
import os
import socket
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    """Whether the user asked for offline mode (``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE``)."""
    return any(
        os.environ.get(var, "").strip().lower() in _TRUE
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint opens within ``timeout_s``.

    ``huggingface_hub`` retries a failing request for about 25 s; probing once first lets
    callers fail (or fall back) at once when there is no network.
    """
    if hub_offline():
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (443 if endpoint.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError as err:
        logger.info("Hugging Face hub at %s:%d is not reachable (%s)", host, port, err)
        return False
