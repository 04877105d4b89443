"""``slice`` and ``check_empty``, checkpointable: their state is a count; ``rsample``, which refuses to resume."""

from __future__ import annotations

import builtins
import itertools
import random
from collections.abc import Iterator
from typing import Any

from wdsraft.core.errors import StateMismatchError
from wdsraft.pipeline.stage import Context, Curried, Stage


class slice(Curried, Stage):
    """``itertools.islice`` over the items, with the count of items seen kept in the state."""

    holds_items = False  # (each item it keeps goes out at once)

    def __init__(self, *args: int | None):
        self.args = args
        self._seen = 0

    def config(self) -> dict[str, Any]:
        return {"args": list(self.args)}

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self._seen}

    def replay(self, src: Iterator[Any]) -> Iterator[Any]:
        return src  # items held downstream passed the slice

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        self._seen = state["seen"] if state else 0
        return self._slice(src, builtins.slice(*self.args))

    def _slice(self, src: Iterator[Any], bounds: builtins.slice) -> Iterator[Any]:
        start, stop, step = bounds.start or 0, bounds.stop, bounds.step or 1
        if stop is not None and self._seen >= stop:
            return
        for item in src:
            index = self._seen
            self._seen += 1
            if index >= start and (index - start) % step == 0:
                yield item
            if stop is not None and self._seen >= stop:
                return  # like islice: nothing more is pulled from upstream


class check_empty(Stage):
    """Raise if a whole pass produced nothing (webdataset.WebDataset's empty_check), counting across restores."""

    holds_items = False

    def __init__(self) -> None:
        self._count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self._count}

    def replay(self, src: Iterator[Any]) -> Iterator[Any]:
        return src

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        self._count = state["count"] if state else 0
        # Resuming elastically, a worker may find all its shards consumed already: nothing is wrong.
        return self._check(src, skipping=ctx.skip is not None)

    def _check(self, src: Iterator[Any], skipping: bool) -> Iterator[Any]:
        for sample in src:
            self._count += 1
            yield sample
        if self._count == 0 and not skipping:
            raise ValueError(
                "No samples found in dataset; perhaps you have fewer shards than workers.\n"
                "Turn off using empty_check=False in the WebDataset constructor."
            )


class rsample(Curried, Stage):
    """Keep each item with probability ``p``, drawing from the global ``random`` as webdataset does.

    The draws cannot be replayed, so a state taken with this stage in the pipeline is refused when
    it is loaded, with a message saying why (taking the state itself works: training that never
    resumes is not stopped at every snapshot of a DataLoader's workers).
    """

    holds_items = False

    def __init__(self, p: float = 0.5):
        self.p = p

    def config(self) -> dict[str, Any]:
        return {"p": self.p}

    def state_dict(self) -> dict[str, Any]:
        return {"resumable": False}

    def epoch_start_state(self) -> dict[str, Any]:
        return {"resumable": False}  # (before the source too: its draws picked the shards)

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        if state is not None and state.get("resumable") is False:
            raise StateMismatchError(
                f"cannot resume stage {self.index} (rsample): it keeps items by draws from the global random "
                "generator, which a restore cannot replay; select items by a hash of their key instead (a "
                "deterministic select), or restart the epoch"
            )
        return (item for item in src if random.uniform(0, 1) < self.p)


def _rsample(data: Iterator[Any], p: float = 0.5) -> Iterator[Any]:
    """webdataset's ``_rsample``, run by :class:`rsample`: the same draws from the global ``random``."""
    assert 0.0 <= p <= 1.0
    yield from rsample(p)(data)


slice.f = staticmethod(itertools.islice)  # (webdataset's slice is pipelinefilter(itertools.islice))
rsample.f = staticmethod(_rsample)
