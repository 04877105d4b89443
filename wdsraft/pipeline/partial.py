"""The raw item that plain functions right after the source are part-way through.

A plain function that yields several items per item (a flat-map written as a generator) holds the rest
of the current raw item where no stage state sees it, and the source is already past that raw item. The
pass counts, at the first point that tracks items (the first ``Stage`` after those plain functions, or
the pipeline's output), how many items of the current raw item went past; a state records the address of
the next one, ``(raw address..., count)``. A restore re-reads that raw item, replays the plain functions
over it, drops what already went past, and hands out the rest before the source goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from wdsraft.core.errors import StateMismatchError
from wdsraft.pipeline.addresses import Address
from wdsraft.pipeline.splitwatch import END, Lookahead
from wdsraft.pipeline.stage import Context, SourceStage, invoke_stage


class PartialTracker:
    """Counts the items of the current raw item past the tracking point (the source's stamp: its serial)."""

    __slots__ = ("base", "count", "rereads", "serial", "split")

    def __init__(self, rereads: bool) -> None:
        self.serial = -1
        self.base: Address | None = None
        self.count = 0
        #: Whether a raw item gave several items in this pass (what a source that cannot re-read refuses).
        self.split = False
        #: Whether the source can re-read its current raw item (else states are refused once a split is seen).
        self.rereads = rereads

    def seen(self, ctx: Context) -> None:
        """One item went past (called per item: a compare, a store)."""
        if ctx.serial != self.serial:
            if self.count > 1:
                self.split = True
            self.serial, self.base, self.count = ctx.serial, ctx.provenance, 1
        else:
            self.count += 1

    def next_address(self) -> list[Any]:
        """The address of the next item of the current raw item, as a plain list ([] before any item; right
        after a restore, before anything went past, the restored one)."""
        base = self.base
        if base is None:
            return []
        return [*base[:-1], base[-1] + self.count]


def counted(ctx: Context, items: Iterator[Any], tracker: PartialTracker) -> Iterator[Any]:
    """``items``, counted as they go into the first stage after the plain functions."""
    seen = tracker.seen
    for item in items:
        seen(ctx)
        yield item


def handed_out(ahead: Lookahead, items: Iterator[Any]) -> Iterator[Any]:
    """``items`` (out of plain functions after a source that cannot re-read), and right after the item a state
    was taken at, the one it pulled to learn whether that raw item had more (``splitwatch.Lookahead``)."""
    ahead.items = items = iter(items)
    for item in items:
        yield item
        while ahead.held:
            held = ahead.take()
            if held is END:
                return
            yield held


def rest_of_item(ctx: Context, source: SourceStage, plain: list[Any], saved: list[Any]) -> Iterator[Any]:
    """The items of the raw item at ``saved`` (``[raw address..., n]``) from the n-th on: re-read, replayed
    through the plain functions, stamped ``(raw address..., n)`` so the stages after number them n, n+1..."""
    address: Address = tuple(saved)
    raw = source.rematerialize([(*address[:-1], 0)])[0]
    stream: Iterator[Any] = iter([raw])
    for stage in plain:
        stream = invoke_stage(stage, stream)
    produced = list(stream)
    if len(produced) < address[-1]:
        raise StateMismatchError(
            f"re-reading item {address[:-1]} gave {len(produced)} items after the plain stages, the state says "
            f"{address[-1]} had gone out: are the stages deterministic?"
        )
    ctx.stamp(address)
    yield from produced[address[-1] :]
