"""``concat_datasets``: checkpointable datasets one after another (epochraft's ``concat_datasets``).

Its state is which dataset is being read and that dataset's own ``state_dict()``; datasets after it
start fresh, at the same epoch. Items are numbered in the pass, as a mix's are (``SnapshotSource``),
so stages after it (a shuffle) can save what they hold.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from wdsraft.core.state import describe
from wdsraft.pipeline.datapipeline import DataPipeline
from wdsraft.pipeline.nested import END, SnapshotSource, adopt_seed_records, pass_skip_on, seed_records
from wdsraft.pipeline.stage import Context, unresumable_state


class ConcatSource(SnapshotSource):
    """The items of ``datasets[0]``, then those of ``datasets[1]``..."""

    def __init__(self, datasets: Sequence[Any]):
        super().__init__()
        if not datasets:
            raise ValueError("concat_datasets: give at least one dataset")
        self.datasets = list(datasets)
        self._current = 0
        self._epoch = 0
        self._iterator: Iterator[Any] | None = None

    def config(self) -> dict[str, Any]:
        configs = []
        for dataset in self.datasets:
            config = getattr(dataset, "config", None)
            configs.append(describe(config() if callable(config) else type(dataset)))
        return {"datasets": configs}

    def start(self, ctx: Context, state: dict[str, Any] | None) -> None:
        self._epoch = ctx.epoch
        # An elastic resume's consumed set reaches every dataset: each runs the concatenation's epoch.
        for index, dataset in enumerate(self.datasets):
            pass_skip_on(dataset, ctx, f"dataset {index} of concat_datasets")
        self._current = state["current"] if state is not None else 0
        self._iterator = None
        if self._current < len(self.datasets):
            self._open(state["dataset"] if state is not None else None)

    def _open(self, state: dict[str, Any] | None) -> None:
        dataset = self.datasets[self._current]
        if state is not None:
            dataset.load_state_dict(state)
        else:
            set_epoch = getattr(dataset, "set_epoch", None)
            if set_epoch is not None:  # (every dataset runs the concatenation's epoch, also after a restore)
                set_epoch(self._epoch)
        self._iterator = iter(dataset)

    def fetch(self) -> Any:
        while self._iterator is not None:
            item = next(self._iterator, END)
            if item is not END:
                return item
            self._current += 1
            self._iterator = None
            if self._current < len(self.datasets):
                self._open(None)
        return END

    def whole_state(self) -> dict[str, Any]:
        if self._current >= len(self.datasets):
            return {"current": self._current, "dataset": None}
        dataset = self.datasets[self._current]
        if not callable(getattr(dataset, "state_dict", None)):
            return {
                "current": self._current,
                "dataset": unresumable_state(
                    f"cannot save stage {self.index} (concat_datasets): dataset {self._current} "
                    f"({type(dataset).__name__}) has no state_dict()"
                ),
            }
        # (None before its first item: a dataset not started yet starts fresh)
        return {"current": self._current, "dataset": dataset.state_dict() if self._iterator is not None else None}

    def drawn_seed(self) -> Any:
        # The datasets' own drawn seeds: a state taken between two epochs must make the next one draw the same.
        return {"datasets": seed_records(self.datasets)}

    def adopt_seed(self, seed: Any) -> None:
        adopt_seed_records(self.datasets, seed.get("datasets") if isinstance(seed, dict) else None)


class ConcatDatasets(DataPipeline):
    """Checkpointable datasets one after another: the pipeline ``concat_datasets`` returns. Add stages
    with ``.compose(stage, ...)``, or use it as the first stage of another pipeline."""

    def __init__(self, datasets: Sequence[Any]):
        super().__init__(ConcatSource(datasets))
        self.datasets = list(datasets)


def concat_datasets(datasets: Sequence[Any]) -> ConcatDatasets:
    """The items of each dataset in turn, checkpointable (each dataset must have ``state_dict()`` /
    ``load_state_dict()``: a ``WebDataset``, a ``DataPipeline``, a mix, another concatenation)."""
    return ConcatDatasets(datasets)
