"""The job config's sections, a few per module; ``titan_kedro.config.schema`` assembles them.

- ``base``: ``Section`` (the base of every section) and ``section_from_params``;
- ``inputs``: what is trained on what: ``job``, ``data``, ``tokenizer``, ``model``;
- ``training``: ``training``, ``optimizer``, ``lr_scheduler``, ``parallelism``,
  ``fault_tolerance``;
- ``launch``: where the job runs and whether it fits there: the schedulers, ``launch``
  (with ``LaunchResources``) and ``plan``;
- ``outputs``: what a run keeps and reports: ``checkpoint``, ``metrics``, ``validation``,
  ``evaluation``, ``export``.

Import them from ``titan_kedro.config.schema``, which re-exports every name.
"""
