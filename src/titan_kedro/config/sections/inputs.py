"""Sections of what is trained on what: the job's identity, the data, the tokenizer, the model."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from titan_kedro.config.sections.base import Section
from titan_kedro.config.sections.tokenize import TORCHX_EXECUTOR, TokenizeSection


class JobSection(Section):
    name: str = "titan-kedro"
    """Human-readable run name, used as the MLflow run name and in log lines."""
    seed: StrictInt = 42
    """Seed for model init, data order and sampling; the same seed gives the same losses."""
    dump_folder: str = "data/07_model_output/job"
    """Where the resolved job config and worker summaries are written."""
    run_id: str | None = None
    """This run's identity (the MLflow run id, or a generated one); set by the training node."""


class DataSection(Section):
    source: Literal["local", "hub"] = "local"
    """``local``: C4 JSON-lines shards under ``raw_dir``; ``hub``: stream ``hub_dataset``."""
    raw_dir: str = "data/01_raw/c4"
    """Folder of ``*.json`` / ``*.json.gz`` C4 shards; in the Kedro project both this and the
    catalog's ``c4_raw`` come from the ``c4_raw_dir`` global (``conf/<env>/globals.yml``)."""
    hub_dataset: str = "allenai/c4"
    """Hugging Face dataset id streamed when ``source`` is ``hub``."""
    hub_config: str = "en"
    """Dataset config name on the hub."""
    hub_split: str = "train"
    """Split streamed from the hub."""
    hub_max_documents: StrictInt = Field(10_000, gt=0)
    """How many documents to take from the hub stream."""
    token_dir: str = "data/05_model_input/tokens"
    """Where packed ``uint32`` token files and ``metadata.json`` live (must match the catalog's ``token_files``)."""
    intermediate_dir: str = "data/02_intermediate/c4_tokens"
    """Per-shard token files and their ``manifest.json``; re-runs only process shards not recorded there."""
    validation_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    """Share of documents held out for validation, chosen by a stable hash of the text."""
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    """Fail the run if more than this share of records is skipped as bad input."""
    min_chars: StrictInt = Field(1, ge=1)
    """Documents shorter than this (after stripping) are skipped as ``empty``."""
    max_line_bytes: StrictInt = Field(8 << 20, gt=0)
    """Lines of a local shard longer than this many (decompressed) bytes are skipped as
    ``line_too_long`` without being assembled, so one huge line costs neither memory nor
    quadratic time. 8 MiB: C4 documents are at most a few hundred KB, even JSON-escaped."""
    num_workers: StrictInt = Field(0, ge=0)
    """Tokenizer lanes: this process plus ``num_workers - 1`` helper processes; 0 = one per core."""
    batch_size: StrictInt = Field(512, gt=0)
    """Documents per tokenizer batch."""
    max_documents: StrictInt | None = Field(None, gt=0)
    """Stop after this many documents in total (None: the whole corpus)."""
    tokenize: TokenizeSection = Field(default_factory=TokenizeSection)
    """Where the shards are tokenized: this machine's pool, or a TorchX job of many tasks."""

    @model_validator(mode="after")
    def _tasks_split_local_shards(self) -> DataSection:
        if self.tokenize.executor != TORCHX_EXECUTOR:
            return self
        if self.source != "local":
            raise ValueError(
                "data.tokenize.executor: torchx splits local shards into ranges, but "
                f"data.source is {self.source!r}; set data.source: local (shards under "
                "data.raw_dir) or data.tokenize.executor: local"
            )
        if self.max_documents is not None:
            raise ValueError(
                "data.max_documents counts documents across shards, which tasks tokenizing "
                "shard ranges side by side cannot; set data.max_documents: null, or "
                "data.tokenize.executor: local"
            )
        return self


class TokenizerSection(Section):
    name_or_path: str = "deepseek-ai/DeepSeek-V2-Lite"
    """A local folder, a hub id (via the HF cache), else the offline DeepSeek-V2 files."""


class ModelSection(Section):
    name: str = "deepseek_v2"
    """Registered train spec name (``deepseek_v2``, ``llama3`` or a custom one)."""
    flavor: str = "debugmodel"
    """Named model size inside the spec (``debugmodel``, ``v2-lite``, ``v2``, ``8B`` …)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Model-argument overrides applied on top of the flavor (``{n_layers: 2}``)."""
    custom_model_path: str | None = None
    """A ``.py`` file imported before resolution; it calls ``register_train_spec``. Runs user code.
    A relative path is taken from the working directory (the project root under ``kedro run``)."""
    custom_import: str | None = None
    """A dotted module imported before resolution; it calls ``register_train_spec``. Runs user code."""

    @field_validator("name", "flavor")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("custom_model_path")
    @classmethod
    def _python_file(cls, value: str | None) -> str | None:
        if value is not None and not value.endswith(".py"):
            raise ValueError(
                "must be the path of a .py file; use model.custom_import for a dotted module name"
            )
        return value

    @field_validator("custom_import")
    @classmethod
    def _dotted_name(cls, value: str | None) -> str | None:
        if value is not None and not all(part.isidentifier() for part in value.split(".")):
            raise ValueError(
                "must be a dotted module name such as 'my_models.tiny_gpt'; "
                "use model.custom_model_path for a .py file"
            )
        return value
