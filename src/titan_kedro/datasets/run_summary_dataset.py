"""``RunSummaryDataset``: the training summary as JSON, loaded back as this run saved it."""

from __future__ import annotations

import copy
from typing import Any

from kedro_datasets.json import JSONDataset


class RunSummaryDataset(JSONDataset):
    """A ``json.JSONDataset`` whose ``load`` returns what this process saved, if anything.

    Several ``kedro run`` s may share the file (one project folder): the stages after
    training in the same run get that run's own summary, never a file another run wrote
    over since. A stage run on its own (nothing saved here) reads the file: the summary of
    the last training that finished. The file, and kedro-viz's preview, are JSONDataset's.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._saved: Any = None

    def save(self, data: Any) -> None:
        super().save(data)
        self._saved = copy.deepcopy(data)

    def load(self) -> Any:
        if self._saved is not None:
            return copy.deepcopy(self._saved)
        return super().load()
