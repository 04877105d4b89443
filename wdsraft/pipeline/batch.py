"""``batched``, ``unbatched`` and ``unlisted``, checkpointable: a partial batch is saved as its
items' addresses, a batch being split as the batch's address and the index within it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
from webdataset.filters import TorchTensor, combine_values, default_collation_fn

from wdsraft.core.state import describe
from wdsraft.pipeline.addresses import Address, pack_addresses, unpack_addresses
from wdsraft.pipeline.stage import AddressTracker, Context, Curried, SourceStage, Stage, unresumable_state


class BatchFormat(Protocol):
    """A kind of item that webdataset's collation cannot batch, and how to batch and split it.

    A layer above the pipeline registers one (``wdsraft.llm`` does for token sequences, whose
    ragged ``cu_seqlens`` do not stack), so that ``batched`` and ``unbatched`` handle it without
    knowing what it is.
    """

    @property
    def collate(self) -> Callable[[list[Any]], Any]:
        """The collation function that stands for this format when passed as ``collation_fn``."""
        ...

    def is_item(self, item: Any) -> bool:
        """Whether ``item`` is of this kind (``batched`` looks at a batch's first item)."""
        ...

    def collate_batch(self, items: list[Any]) -> Any:
        """The batch of ``items`` (``collate``, plus whatever the format notes about batches it made)."""
        ...

    def is_batch(self, batch: Any) -> bool:
        """Whether ``batch`` is one that ``collate_batch`` made."""
        ...

    def split(self, batch: Any) -> list[Any]:
        """The items of a batch of this kind, as they were before collation."""
        ...


_batch_formats: list[BatchFormat] = []


def register_batch_format(batch_format: BatchFormat) -> None:
    """Let ``batched`` (with its default collation) and ``unbatched`` handle another kind of item."""
    if batch_format not in _batch_formats:
        _batch_formats.append(batch_format)


def _format_of_items(collation_fn: Any, first: Any) -> BatchFormat | None:
    for batch_format in _batch_formats:
        if collation_fn in (default_collation_fn, batch_format.collate) and batch_format.is_item(first):
            return batch_format
    return None


class batched(Curried, Stage):
    """Group items into batches of ``batchsize`` (collated with ``collation_fn``), as webdataset's.

    As webdataset's, a full batch is handed out when the item after it arrives, so between two batches
    that item is held; the partial batch at a checkpoint is saved as its items' addresses.
    """

    def __init__(
        self, batchsize: int = 20, collation_fn: Callable[[list[Any]], Any] | None = default_collation_fn, partial=True
    ):
        self.batchsize = batchsize
        self.collation_fn = collation_fn
        self.partial = partial
        self._addresses: list[Address | None] = []

    def config(self) -> dict[str, Any]:
        return {"batchsize": self.batchsize, "collation_fn": describe(self.collation_fn), "partial": self.partial}

    def state_dict(self) -> dict[str, Any]:
        if None in self._addresses:
            return unresumable_state(
                f"cannot save stage {self.index} (batched): items of its partial batch have no position in the "
                "shards (a stage before it merges items, or the pipeline's reader gives no positions)"
            )
        return {"partial": pack_addresses(self._addresses)}  # type: ignore[arg-type]

    def addresses(self) -> list[Address]:
        return [address for address in self._addresses if address is not None]

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        self._addresses = unpack_addresses(state["partial"]) if state else []  # type: ignore[assignment]
        return self._batches(ctx, src, look_ahead=not _after_a_merge(ctx, self.index))

    def _batches(self, ctx: Context, src: Iterator[Any], look_ahead: bool) -> Iterator[Any]:
        addresses = self._addresses
        batch: list[Any] = ctx.rematerializers[self.index](list(addresses)) if addresses else []  # type: ignore[arg-type]
        batchsize = self.batchsize
        # ``AddressTracker.address`` inline (a call less per item): an item's address is its raw item's (the
        # stamp), its last field plus how many items from the same stamp came before it.
        serial, sub = -1, 0
        for sample in src:
            base = ctx.provenance
            if base is None:
                address = None
            elif ctx.serial != serial:
                serial, sub = ctx.serial, 1
                address = base if type(base) is tuple else (*base[:-1], base[-1])
            else:
                address = (*base[:-1], base[-1] + sub)
                sub += 1
            if len(batch) >= batchsize:
                # As webdataset's: a full batch goes out when the item after it arrives (the same pulls from
                # upstream, so a live RNG shared with other passes draws the same); that item is held, by address.
                out = self._emit(ctx, batch)
                batch.clear()
                addresses.clear()
                batch.append(sample)
                addresses.append(address)
                upstream = ctx.hand_out(None)  # a batch has many sources: stages after it cannot address it
                yield out
                ctx.resume(upstream)
                continue
            batch.append(sample)
            addresses.append(address)
            if not look_ahead and len(batch) >= batchsize:
                # Items made by a merging stage (token chunks, batches) have no position and could not be saved
                # if held: the batch goes out as soon as it is full.
                out = self._emit(ctx, batch)
                batch.clear()
                addresses.clear()
                upstream = ctx.hand_out(None)
                yield out
                ctx.resume(upstream)
        if batch and (len(batch) == self.batchsize or self.partial):
            out = self._emit(ctx, batch)
            batch.clear()
            addresses.clear()
            ctx.hand_out(None)  # (the input has ended: nothing to put back)
            yield out

    def _emit(self, ctx: Context, batch: list[Any]) -> Any:
        if self.collation_fn is None:
            return list(batch)
        batch_format = _format_of_items(self.collation_fn, batch[0])
        if batch_format is not None:
            return batch_format.collate_batch(list(batch))
        if self.collation_fn is default_collation_fn:
            return _collate_dicts(batch)
        return self.collation_fn(list(batch))


class _Splitter(Curried, Stage):
    """Shared machinery of unbatched/unlisted: hands out the items of each incoming group one by one."""

    def __init__(self) -> None:
        self._group_address: Address | None = None
        self._next = 0
        self._pending = 0

    def split(self, group: Any) -> list[Any]:
        raise NotImplementedError

    def replay(self, src: Iterator[Any]) -> Iterator[Any]:
        for group in src:
            yield from self.split(group)

    def state_dict(self) -> dict[str, Any]:
        if self._pending and self._group_address is None:
            return unresumable_state(
                f"cannot save stage {self.index} ({type(self).__name__}): it is in the middle of a batch made "
                "inside this pipeline, which cannot be re-read; put unbatching after a DataLoader (WebLoader) "
                "or save between batches"
            )
        group = list(self._group_address) if self._pending and self._group_address is not None else None
        return {"group": group, "next": self._next}

    def addresses(self) -> list[Address]:
        return [self._group_address] if self._pending and self._group_address is not None else []

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        resume = state is not None and state.get("group") is not None
        self._group_address = tuple(state["group"]) if resume else None  # type: ignore[index]
        self._next = state["next"] if resume else 0  # type: ignore[index]
        self._pending = 1 if resume else 0  # until the group is re-read and its length known
        return self._items(ctx, src)

    def _items(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        tracker = AddressTracker(ctx)
        if self._pending:
            address = self._group_address
            assert address is not None
            (group,) = ctx.rematerializers[self.index]([address])
            yield from self._hand_out(ctx, group, address, self._next)
        for group in src:
            yield from self._hand_out(ctx, group, tracker.address(), 0)

    def _hand_out(self, ctx: Context, group: Any, address: Address | None, start: int) -> Iterator[Any]:
        items = self.split(group)
        self._group_address = address
        for position in range(start, len(items)):
            self._next = position + 1
            self._pending = len(items) - position - 1
            # Item `position` of what replaying the stages up to here makes of the group's source.
            upstream = ctx.hand_out(None if address is None else (*address[:-1], address[-1] + position))
            yield items[position]
            ctx.resume(upstream)
        self._pending = 0


class unbatched(_Splitter):
    """Split collated batches (tuples/lists of columns, or dicts of columns) back into items."""

    def split(self, sample: Any) -> list[Any]:
        if isinstance(sample, (list, tuple)):
            return [tuple(x[i] for x in sample) for i in range(len(sample[0]))]
        for batch_format in _batch_formats:  # (a registered kind first: its batch may also be a dict)
            if batch_format.is_batch(sample):
                return batch_format.split(sample)
        if isinstance(sample, dict):
            lengths = {len(v) for v in sample.values()}
            assert len(lengths) == 1, lengths
            n = next(iter(lengths))
            return [{k: v[i] for k, v in sample.items()} for i in range(n)]
        raise ValueError(f"unknown sample type: {type(sample)}")


class unlisted(_Splitter):
    """Split lists (batches made with ``collation_fn=None``) back into items."""

    def split(self, batch: Any) -> list[Any]:
        assert isinstance(batch, list), batch
        return batch


def _batched(
    data: Iterator[Any],
    batchsize: int = 20,
    collation_fn: Callable[[list[Any]], Any] | None = default_collation_fn,
    partial: bool = True,
) -> Iterator[Any]:
    """webdataset's ``_batched`` (the function its ``batched`` curries), run by :class:`batched`. Without state."""
    yield from batched(batchsize, collation_fn=collation_fn, partial=partial)(data)


def _unbatched(data: Iterator[Any]) -> Iterator[Any]:
    """webdataset's ``_unbatched``, run by :class:`unbatched`. Without state."""
    yield from unbatched()(data)


def _unlisted(data: Iterator[Any]) -> Iterator[Any]:
    """webdataset's ``_unlisted``, run by :class:`unlisted`. Without state."""
    yield from unlisted()(data)


def _collate_dicts(samples: list[Any]) -> Any:
    """webdataset's ``default_collation_fn(samples)``, the same batch (the same key order too), with fewer
    steps for samples that are plain dicts: their keys are compared as views (webdataset builds a set per
    sample) and a column of values that stay a list is not copied once more. Anything else, and any
    mismatch, goes to webdataset's own function (its checks, its errors)."""
    first = samples[0]
    if type(first) is not dict:
        return default_collation_fn(list(samples))
    keys = set(first.keys())  # (built as webdataset builds it: a set's order depends on how it grew)
    for row in samples:
        if type(row) is not dict or row.keys() != keys:
            return default_collation_fn(list(samples))
    result = {}
    for key in keys:
        column = [row[key] for row in samples]
        value = column[0]
        if isinstance(value, (int, float, TorchTensor, np.ndarray)):
            result[key] = combine_values(column)
        else:
            result[key] = column  # (combine_values would copy it: list(column))
    return result


def _after_a_merge(ctx: Context, index: int) -> bool:
    """Whether a stage between the pipeline's source and stage ``index`` merges items (its ``replay`` is the
    default one): the items reaching ``index`` then have no position."""
    upstream = ctx.stages[:index]
    start = max((i + 1 for i, stage in enumerate(upstream) if isinstance(stage, SourceStage)), default=0)
    return any(isinstance(stage, Stage) and type(stage).replay is Stage.replay for stage in upstream[start:])


batched.f = staticmethod(_batched)
unbatched.f = staticmethod(_unbatched)
unlisted.f = staticmethod(_unlisted)
