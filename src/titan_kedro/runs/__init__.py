"""What is about runs rather than training: identity, folders, locks and processes.

A room below both ``train/`` (the workers) and ``launch/`` (the launchers): both import
it, it imports neither (nor ``plan/``, ``pipelines/`` or ``hooks/``). Nothing here needs
torch at import time.

Rooms: ``identity`` (run ids, what a continued run may change, the metadata a checkpoint
records), ``lock`` (one writer per run folder), ``checkpoint_layout`` (the ``step-<n>``
folders), ``checkpoint_metadata`` (``CheckpointMetadata``: what ``metadata.json`` holds,
its one writer and reader), ``resume`` (finding checkpoints and the one resolution of
``checkpoint.resume``), ``parent_death`` (a process that ends with its parent: torchrun's
wrapper and the workers), ``loopback_agent`` (torchrun whose stores listen on
127.0.0.1) and ``frozen_imports`` (what a process imports stays out of the cyclic
collector's walks). Saving and loading tensors stays in ``train.checkpoint``.
"""
