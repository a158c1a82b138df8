"""Record which job-config fields code actually reads, to find fields nothing uses.

``recording()`` wraps ``Section.__getattribute__`` so every read of a declared field of
any config section instance (``cfg.training.steps``, ``getattr(section, "x", 1)``, a
section built from Kedro parameters by ``section_from_params``) is noted under the class
that declares the field, so ``job.name`` and ``model.name`` are different reads.
Pydantic's own dumping, copying, comparing and printing read the instance ``__dict__``
directly, so they count as no read.

Python processes started with ``recording_env(folder)`` in their environment
(``kedro run``, torchrun and its workers) record too, through a ``sitecustomize`` module,
and each writes its reads to ``folder/reads-<pid>.json`` when it exits.

``branch_reads`` runs the library on the branches one local run cannot take (a Slurm dry
run of a CUDA job, a hub data source); ``unread_fields`` lists the fields outside a set
of reads.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from pydantic import BaseModel

from titan_kedro.config.schema import JobConfig, Section

RECORD_ENV = "TITAN_KEDRO_RECORD_CONFIG_READS"
"""Folder the recording ``sitecustomize`` writes each process's reads to."""

Read = tuple[str, str]
"""(declaring class as ``module.qualname``, field name)."""

_SITECUSTOMIZE = """\
import importlib.util, os
_spec = importlib.util.spec_from_file_location("_titan_field_reads", {path!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
_module.record_until_exit(os.environ[{env!r}])
"""


def _class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _declaring_class(cls: type, name: str) -> type:
    for base in cls.__mro__:
        if name in inspect.get_annotations(base):
            return base
    return cls


def _start_recording(reads: set[Read]) -> Any:
    """Make every field read add to ``reads``; returns what ``_stop_recording`` restores."""
    original = Section.__getattribute__

    def recording_getattribute(self: Any, name: str) -> Any:
        cls = type(self)
        if name in cls.__pydantic_fields__:
            reads.add((_class_key(_declaring_class(cls, name)), name))
        return original(self, name)

    Section.__getattribute__ = recording_getattribute  # type: ignore[method-assign]
    return original


def _stop_recording(original: Any) -> None:
    Section.__getattribute__ = original  # type: ignore[method-assign]


@contextmanager
def recording() -> Iterator[set[Read]]:
    """Collect the field reads made inside the block (and leave ``Section`` as it was)."""
    reads: set[Read] = set()
    original = _start_recording(reads)
    try:
        yield reads
    finally:
        _stop_recording(original)


def record_until_exit(folder: str | Path) -> None:
    """Record for the rest of this process and write the reads to ``folder`` at exit."""
    reads: set[Read] = set()
    _start_recording(reads)

    def write() -> None:
        path = Path(folder) / f"reads-{os.getpid()}.json"
        path.write_text(json.dumps(sorted(reads)), encoding="utf-8")

    atexit.register(write)


def recording_env(folder: Path) -> dict[str, str]:
    """Environment variables that make every Python process started with them record."""
    hook = folder / "sitecustomize"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(
        _SITECUSTOMIZE.format(path=str(Path(__file__).resolve()), env=RECORD_ENV),
        encoding="utf-8",
    )
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, RECORD_ENV: str(folder)}


def read_recorded(folder: Path) -> set[Read]:
    """The union of the reads every recording process wrote to ``folder``."""
    return {
        (cls, name)
        for path in folder.glob("reads-*.json")
        for cls, name in json.loads(path.read_text(encoding="utf-8"))
    }


def config_fields(config: type[BaseModel] = JobConfig) -> dict[Read, str]:
    """Every field of every section (nested sections too) → its dotted path."""
    fields: dict[Read, str] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            fields[(_class_key(_declaring_class(model, name)), name)] = f"{prefix}{name}"
            if isinstance(info.annotation, type) and issubclass(info.annotation, Section):
                walk(info.annotation, f"{prefix}{name}.")

    for section, info in config.model_fields.items():
        walk(info.annotation, f"{section}.")
    return fields


def unread_fields(reads: set[Read], config: type[BaseModel] = JobConfig) -> list[str]:
    """Dotted paths of the fields of ``config`` that ``reads`` does not hold."""
    return sorted(path for key, path in config_fields(config).items() if key not in reads)


def branch_reads(folder: Path) -> set[Read]:
    """The reads of the branches a local CPU run does not take, each run for real.

    - The training node on a Slurm dry run of a two-GPU job (``launch.scheduler``,
      ``scheduler_args``, ``resources``, ``shared_dir``, ``dryrun_dir``; the CUDA plan's
      ``plan.gpu`` and mixed precision), everything under ``folder``.
    - Source selection for ``data.source: hub``, with the network check answered yes
      (nothing is streamed: the source reads the hub only when iterated).
    - Fault tolerance: the launcher's lighthouses started and stopped on 127.0.0.1
      (``fault_tolerance`` sizes, join and heartbeat timeouts, the address). The fields
      only a replica group's worker or its restart loop reads are ``FT_RUN_ONLY``.
    - Tokenizing as a TorchX job: the ``local_cwd`` request of ``data.tokenize`` (plan
      written, nothing submitted); ``TOKENIZE_RUN_ONLY`` is read while the job runs.
    """
    from titan_kedro.config import build_job_config
    from titan_kedro.config.schema import DataSection
    from titan_kedro.data import sources
    from titan_kedro.ft.lighthouse import Lighthouses
    from titan_kedro.pipelines.training.nodes import train_model

    job = {
        "job": {"dump_folder": str(folder / "job")},
        "data": {"token_dir": str(folder / "tokens")},
        "model": {"name": "llama3", "overrides": {"vocab_size": 128, "n_layers": 1}},
        "training": {"device": "cuda", "seq_len": 32, "local_batch_size": 1},
        "launch": {
            "scheduler": "slurm",
            "scheduler_args": {"partition": "gpu"},
            "resources": {"gpus": 2, "cpus": 4, "memory_mb": 8_000},
            "nproc_per_node": 2,
            "shared_dir": str(folder),
            "log_dir": str(folder / "logs"),
            "dryrun": True,
            "dryrun_dir": str(folder / "dryrun"),
        },
        "checkpoint": {"folder": str(folder / "checkpoints")},
        "metrics": {"enable_mlflow": False},
    }
    with recording() as reads:
        summary = train_model({"vocab_size": 128}, {}, **job)
        assert summary["dryrun"] is True, summary
        with (
            mock.patch.object(sources, "hub_offline", return_value=False),
            mock.patch.object(sources, "hub_reachable", return_value=True),
        ):
            (hub,) = sources.select_sources(DataSection(source="hub"), [])
        assert isinstance(hub, sources.HubSource), hub
        ft = build_job_config(
            {"fault_tolerance": {"enable": True, "replica_groups": 2, "min_replicas": 1}}
        ).fault_tolerance
        Lighthouses.start(ft).stop()  # reads lighthouse_bind
        _tokenize_request(folder)
        # auto_continue: read while a remote job is followed (``scheduler.run_job``)
        assert build_job_config({"launch": {"scheduler": "slurm"}}).launch.continues == 3
    from titan_kedro.config.schema import FaultToleranceSection
    from titan_kedro.config.sections.tokenize import TokenizeSection

    return (
        reads
        | {(_class_key(FaultToleranceSection), name) for name in FT_RUN_ONLY}
        | {(_class_key(TokenizeSection), name) for name in TOKENIZE_RUN_ONLY}
    )


def _tokenize_request(folder: Path) -> None:
    from types import SimpleNamespace

    from titan_kedro.config.schema import DataSection
    from titan_kedro.data.sources import ShardFile
    from titan_kedro.launch.tokenize_job import tokenize_request

    shard = folder / "c4" / "c4-train.00000-of-00001.json"
    shard.parent.mkdir(parents=True, exist_ok=True)
    shard.write_text('{"text": "one document"}\n', encoding="utf-8")
    tokenize = {"executor": "torchx", "scheduler": "local_cwd", "log_dir": str(folder / "tok")}
    data = DataSection(intermediate_dir=str(folder / "c4_tokens"), tokenize=tokenize)
    tokenizer = SimpleNamespace(name="tokenizer", fingerprint="0123")  # a plan needs only these
    request = tokenize_request(data, [ShardFile.from_path(shard)], tokenizer)  # type: ignore[arg-type]
    assert "titan_kedro.data.tokenize_task" in request, request


TOKENIZE_RUN_ONLY = ("timeout_s",)
"""Read only while a tokenizing job runs (``tests/launch/test_tokenize_job.py`` runs it)."""
FT_RUN_ONLY = ("quorum_timeout_s", "step_timeout_s", "max_group_restarts")
"""Read only inside a fault-tolerant run (the worker's Manager, the launcher's restart
loop): ``tests/ft`` runs those for real, but not under this recording."""
