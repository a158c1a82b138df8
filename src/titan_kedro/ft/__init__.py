"""Fault-tolerant replica groups with TorchFT (knows nothing of Kedro).

- ``identity``: the launcher's environment (replica id, attempt, lighthouses) and the
  data shard of a rank among all groups.
- ``lighthouse``: the lighthouses the launcher starts on 127.0.0.1 (the quorum's and the
  startup barrier's).
- ``replica``: :class:`ReplicaGroupFT`, the trainer's seam (quorum, gradient averaging,
  commit vote, healing, ``ft/…`` metrics).
- ``transport``: the pickle-free healing transfer over the cross-group process group.
"""
