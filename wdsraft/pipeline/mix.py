"""``RandomMix`` and ``RoundRobin``: webdataset's mixes of several datasets, checkpointable.

A mix's state is its own (the RNG of a random mix, the turn of a round robin, which datasets are
still going) plus each dataset's own ``state_dict()``: a restore loads those into the datasets and
goes on, reading nothing again. The datasets must be checkpointable themselves (``WebDataset``,
``DataPipeline``...); one that is not makes the mix's states unresumable, refused when loaded.

``RandomMix`` draws as webdataset's does: ``random.random()`` per item, the source picked by the
cumulated probabilities. Without ``seed`` it draws from a copy of the global ``random`` taken at its
first pass, and advances the global generator by as many draws, so that for the same global seed the
stream is webdataset's (unless other code draws from the global generator between two of the mix's
draws); the copy is what a state can carry. With ``seed`` it draws from its own ``random.Random(seed)``.
The generator goes on from one epoch to the next, as the global one does in webdataset.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator
from typing import Any

import numpy as np

from wdsraft.core.state import describe, pack_rng, unpack_rng
from wdsraft.pipeline.datapipeline import DataPipeline
from wdsraft.pipeline.nested import END, SnapshotSource, adopt_seed_records, pass_skip_on, seed_records
from wdsraft.pipeline.stage import Context, unresumable_state


class MixSource(SnapshotSource):
    """The items of several datasets, interleaved by ``pick`` (one dataset index per item)."""

    def __init__(self, datasets: list[Any], longest: bool):
        super().__init__()
        self.datasets = datasets
        self.longest = longest
        self._active: list[int] = []
        self._iterators: dict[int, Iterator[Any]] = {}

    # -- what a kind of mix decides ----------------------------------------------------------------------

    def pick(self) -> int:
        """The position, in the active datasets, of the one the next item comes from."""
        raise NotImplementedError

    def exhausted(self, position: int) -> None:
        """The dataset at ``position`` of the active ones ran out (``longest``: it leaves the mix)."""

    def mix_state(self) -> dict[str, Any]:
        return {}

    def adopt_mix_state(self, state: dict[str, Any] | None) -> None:
        pass

    # -- the source ------------------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        configs = []
        for dataset in self.datasets:
            config = getattr(dataset, "config", None)
            configs.append(describe(config() if callable(config) else type(dataset)))
        return {"datasets": configs, "longest": self.longest}

    def start(self, ctx: Context, state: dict[str, Any] | None) -> None:
        self.adopt_mix_state(state)
        for index, dataset in enumerate(self.datasets):
            pass_skip_on(dataset, ctx, f"dataset {index} of the mix")
        if state is None:
            self._active = list(range(len(self.datasets)))
            for dataset in self.datasets:
                set_epoch = getattr(dataset, "set_epoch", None)
                if set_epoch is not None:  # (each dataset's epoch follows the mix's, also after a restore)
                    set_epoch(ctx.epoch)
        else:
            self._active = list(state["active"])
            for key, dataset_state in state["datasets"].items():
                if int(key) in self._active and dataset_state is not None:
                    self.datasets[int(key)].load_state_dict(dataset_state)
        self._iterators = {index: iter(self.datasets[index]) for index in self._active}

    def fetch(self) -> Any:
        while self._active:
            position = self.pick()
            try:
                return next(self._iterators[self._active[position]])
            except StopIteration:
                if not self.longest:
                    self._active = []
                    break
                self.exhausted(position)
                del self._iterators[self._active[position]]
                del self._active[position]
        return END

    def whole_state(self) -> dict[str, Any]:
        datasets: dict[str, Any] = {}  # (a dict: a marker in it is found by the pipeline's check)
        for index, dataset in enumerate(self.datasets):
            if index not in self._active:
                datasets[str(index)] = None
            elif callable(getattr(dataset, "state_dict", None)):
                datasets[str(index)] = dataset.state_dict()
            else:
                datasets[str(index)] = unresumable_state(
                    f"cannot save stage {self.index} ({type(self).__name__}): dataset {index} "
                    f"({type(dataset).__name__}) has no state_dict()"
                )
        return {**self.mix_state(), "active": list(self._active), "datasets": datasets}

    def drawn_seed(self) -> Any:
        # The datasets' own drawn seeds and live RNGs: a state taken between two epochs holds no dataset
        # state, and the next epoch must draw what it would have drawn without the restore.
        return {"datasets": seed_records(self.datasets)}

    def adopt_seed(self, seed: Any) -> None:
        adopt_seed_records(self.datasets, seed.get("datasets") if isinstance(seed, dict) else None)


class _RandomSource(MixSource):
    def __init__(self, datasets: list[Any], probs: Any, longest: bool, seed: Any):
        super().__init__(datasets, longest)
        self.probs = None if probs is None else list(probs)
        self.seed = seed
        self._probs: list[Any] = []
        self._cumulated: list[float] = []
        self._rng: random.Random | None = None  # goes on across epochs, as the global generator does

    def config(self) -> dict[str, Any]:
        return {**super().config(), "probs": describe(self.probs), "seed": describe(self.seed)}

    def drawn_seed(self) -> Any:
        return {**super().drawn_seed(), "rng": pack_rng(self._rng) if self._rng is not None else None}

    def adopt_seed(self, seed: Any) -> None:
        super().adopt_seed(seed)
        if isinstance(seed, dict) and "rng" in seed:  # (None: saved before the first pass drew anything)
            self._rng = unpack_rng(seed["rng"]) if seed["rng"] is not None else None

    def adopt_mix_state(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self._rng = unpack_rng(state["rng"])
            self._set_probs(list(state["probs"]))
            return
        if self._rng is None:
            self._rng = random.Random(self.seed) if self.seed is not None else _copy_of_global()
        self._set_probs([1] * len(self.datasets) if self.probs is None else list(self.probs))

    def _set_probs(self, probs: list[Any]) -> None:
        self._probs = probs
        # (per change, not per item; none left: the mix has ended and draws nothing). webdataset's numpy sums,
        # searched with bisect: np.searchsorted on a scalar cost a microsecond per item, bisect_left is its rule
        self._cumulated = (np.array(probs) / np.sum(probs)).cumsum().tolist() if probs else []

    def mix_state(self) -> dict[str, Any]:
        assert self._rng is not None
        return {"rng": pack_rng(self._rng), "probs": list(self._probs)}

    def pick(self) -> int:
        assert self._rng is not None
        draw = self._rng.random()
        if self.seed is None:
            random.random()  # the global generator advances as under webdataset
        return bisect.bisect_left(self._cumulated, draw)

    def exhausted(self, position: int) -> None:
        self._set_probs(self._probs[:position] + self._probs[position + 1 :])


def _copy_of_global() -> random.Random:
    rng = random.Random()
    rng.setstate(random.getstate())
    return rng


class _RoundRobinSource(MixSource):
    def __init__(self, datasets: list[Any], longest: bool):
        super().__init__(datasets, longest)
        self._turn = 0

    def adopt_mix_state(self, state: dict[str, Any] | None) -> None:
        self._turn = state["turn"] if state is not None else 0

    def mix_state(self) -> dict[str, Any]:
        return {"turn": self._turn}

    def pick(self) -> int:
        position = self._turn % len(self._active)
        self._turn = position + 1  # (webdataset's longest form counts from the position; both agree here)
        return position

    def exhausted(self, position: int) -> None:
        self._turn = position  # the next dataset moved into this position


class RandomMix(DataPipeline):
    """webdataset's ``RandomMix``: each item from a dataset drawn with probability ``probs`` (equal by
    default); ``longest`` goes on until every dataset has run out. Checkpointable; ``seed`` (wdsraft's)
    gives the mix its own generator."""

    #: How often a pipeline that reads this mix as its first stage keeps the mix's whole state (``PipelineSource``):
    #: every 64 items that cost about 0.9 us an item for three datasets, every 256 (as ``interleave_datasets``)
    #: too little to measure (benchmarks/mix_throughput.py --nested-snapshot-every); a restore fetches again at
    #: most 255 items more than the stages after it hold.
    nested_snapshot_every = 256

    def __init__(self, datasets: list[Any], probs: Any = None, longest: bool = False, seed: Any = None):
        super().__init__(_RandomSource(list(datasets), probs, longest, seed))
        self.datasets = datasets
        self.probs = probs
        self.longest = longest

    def iterator(self) -> Iterator[Any]:
        source = self.pipeline[0]
        if source._rng is None and source.seed is None:
            # The copy of the global generator is taken at iter(), as webdataset starts drawing from it then;
            # a state taken before the first item already holds it.
            source._rng = _copy_of_global()
        return super().iterator()


class RoundRobin(DataPipeline):
    """webdataset's ``RoundRobin``: one item from each dataset in turn; ``longest`` goes on until every
    dataset has run out, else the mix ends with the first that does. Checkpointable."""

    nested_snapshot_every = 256  # (as RandomMix's)

    def __init__(self, datasets: list[Any], longest: bool = False):
        super().__init__(_RoundRobinSource(list(datasets), longest))
        self.datasets = datasets
        self.longest = longest
