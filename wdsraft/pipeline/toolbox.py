"""epochraft's small stages, checkpointable: ``take(n)``, ``stride(k, offset)`` (both a ``slice``, whose
state is a count) and ``enumerate(count_column)``, which adds a running index to each sample.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from typing import Any

from wdsraft.core.errors import StateMismatchError
from wdsraft.pipeline.addresses import Address, pack_addresses, unpack_addresses
from wdsraft.pipeline.slice import slice
from wdsraft.pipeline.stage import AddressTracker, Context, Curried, SourceStage, Stage


def take(n: int) -> slice:
    """The first ``n`` items of each pass (fewer if the pass ends first); nothing more is pulled from
    upstream once ``n`` went out. Per DataLoader worker when it runs inside the workers."""
    if n < 0:
        raise ValueError(f"take: n must be >= 0, not {n}")
    return slice(n)


def stride(k: int, offset: int = 0) -> slice:
    """Every ``k``-th item of each pass, from item ``offset`` (epochraft's ``stride(interval, offset)``)."""
    if k < 1:
        raise ValueError(f"stride: k must be >= 1, not {k}")
    if not 0 <= offset < k:
        raise ValueError(f"stride: offset must be in [0, {k}), not {offset}")
    return slice(offset, None, k)


class enumerate(Curried, Stage):
    """Set ``sample[count_column]`` to the sample's number in the pass (0, 1, 2...), as epochraft's
    ``enumerate`` (its default column, ``"step"``, too).

    State: the count, plus the numbers of the samples that stages after it hold (a shuffle buffer,
    a partial batch) with their addresses, so that re-reading them on restore gives them their numbers
    again. Samples must be dicts.
    """

    #: How many numbered samples to remember before dropping those no stage after this one holds.
    keep = 256
    holds_items = False  # (it numbers each sample and hands it out at once)

    def __init__(self, count_column: str = "step"):
        self.count_column = count_column
        self._count = 0
        self._numbers: dict[Address, int] = {}  # input address -> number, for samples held downstream
        self._ctx: Context | None = None

    def config(self) -> dict[str, Any]:
        return {"count_column": self.count_column}

    def state_dict(self) -> dict[str, Any]:
        held = self._held()
        return {"count": self._count, "held": pack_addresses(held), "numbers": [self._numbers[a] for a in held]}

    def replay(self, src: Iterator[Any]) -> Iterator[Any]:
        raise StateMismatchError(
            f"stage {self.index} (enumerate): a sample's number depends on where it was; re-create it with replay_at"
        )

    def replay_at(self, src: Iterator[Any], address: Address) -> Iterator[Any]:
        for sub, sample in builtins.enumerate(src):
            key = (*address[:-1], address[-1] + sub)
            number = self._numbers.get(key)
            if number is None:
                raise StateMismatchError(
                    f"stage {self.index} (enumerate): no number saved for the sample at {key}; was the state "
                    "taken by the same pipeline?"
                )
            yield self._numbered(sample, number)

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        self._ctx = ctx
        self._count = state["count"] if state else 0
        self._numbers = {}
        if state:
            held = unpack_addresses(state["held"])
            self._numbers = dict(zip(held, state["numbers"], strict=True))
        return self._enumerate(ctx, src)

    def _enumerate(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        # Numbers are remembered only where a stage after this one may hold samples.
        remember = any(isinstance(stage, Stage) and stage.holds_items for stage in ctx.stages[self.index + 1 :])
        tracker = AddressTracker(ctx)
        limit = self.keep
        for sample in src:
            number = self._count
            self._count += 1
            if remember:
                address = tracker.address()
                if address is not None:
                    if len(self._numbers) >= limit:  # (before this sample goes in: no stage holds it yet)
                        self._numbers = {a: self._numbers[a] for a in self._held()}
                        limit = max(self.keep, 2 * len(self._numbers))  # (a big buffer: prune seldom)
                    self._numbers[address] = number
            yield self._numbered(sample, number)

    def _numbered(self, sample: Any, number: int) -> Any:
        if not isinstance(sample, dict):
            raise TypeError(
                f"stage {self.index} (enumerate): samples must be dicts to get a {self.count_column!r} field, "
                f"not {type(sample).__name__}; enumerate before to_tuple"
            )
        sample[self.count_column] = number
        return sample

    def _held(self) -> list[Address]:
        """The addresses, among the remembered ones, of samples that stages after this one still hold."""
        if not self._numbers or self._ctx is None:
            return []
        held_raws = {
            address[:-1]
            for stage in self._ctx.stages[self.index + 1 :]
            if isinstance(stage, Stage) and not isinstance(stage, SourceStage)
            for address in stage.addresses()
        }
        return [address for address in self._numbers if address[:-1] in held_raws]
