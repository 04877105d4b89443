"""Pipeline stages: webdataset's stateless filters as they are, checkpointable versions of the others.

``shuffle``, ``detshuffle``, ``batched``, ``unbatched``, ``unlisted`` and ``slice`` hold
items (or a count) between two outputs, so they are :class:`~wdsraft.pipeline.Stage`\\ s
with a state. They produce exactly webdataset's streams for the same seeds; shuffles
reshuffle every epoch (``reshuffle_each_epoch=False`` gives webdataset's same-order-every-
epoch behaviour).
"""

from __future__ import annotations

import builtins
import random
from collections.abc import Callable, Iterator
from typing import Any

from webdataset.filters import (
    Cached,
    FilterFunction,
    LMDBCached,
    RestCurried,
    associate,
    combine_values,
    compose,
    decode,
    default_collation_fn,
    dict2tuple,
    extract_keys,
    getfirst,
    identity,
    info,
    log_keys,
    map,
    map_dict,
    map_tuple,
    parse_field_spec,
    pick,
    pipeline,
    pipelinefilter,
    rename,
    rename_keys,
    reraise_exception,
    rsample,
    select,
    to_tuple,
    transform_with,
    tuple2dict,
    xdecode,
)

from wdsraft import llm
from wdsraft.core.errors import StateMismatchError
from wdsraft.core.state import describe, make_seed, pack_rng, unpack_rng
from wdsraft.pipeline import Address, AddressTracker, Context, Stage, pack_addresses, unpack_addresses

__all__ = [
    "Cached",
    "FilterFunction",
    "LMDBCached",
    "RestCurried",
    "associate",
    "batched",
    "check_empty",
    "combine_values",
    "compose",
    "decode",
    "default_collation_fn",
    "detshuffle",
    "dict2tuple",
    "extract_keys",
    "getfirst",
    "identity",
    "info",
    "log_keys",
    "map",
    "map_dict",
    "map_tuple",
    "parse_field_spec",
    "pick",
    "pipeline",
    "pipelinefilter",
    "rename",
    "rename_keys",
    "reraise_exception",
    "rsample",
    "select",
    "shuffle",
    "slice",
    "to_tuple",
    "transform_with",
    "tuple2dict",
    "unbatched",
    "unlisted",
    "xdecode",
]


class shuffle(Stage):
    """Buffer shuffle, webdataset's algorithm: fill to ``initial``, then pick at random while refilling.

    State: the RNG (2.5 KB), the buffered items as addresses (their positions in the
    shards), and whether the input has ended. Upstream of the tar reader (a shard
    shuffle), it is replayed from the start of the epoch instead.
    """

    def __init__(
        self,
        bufsize: int = 1000,
        initial: int = 100,
        rng: random.Random | None = None,
        seed: Any = None,
        handler: Any = None,
        reshuffle_each_epoch: bool = True,
    ):
        if seed is not None and rng is not None:
            raise ValueError("shuffle: give seed or rng, not both")
        self.bufsize = bufsize
        self.initial = initial
        self.rng = rng
        self.seed = seed
        self.reshuffle_each_epoch = reshuffle_each_epoch
        # No seed: draw one now (webdataset seeds from the clock at each run); it travels in the state.
        self._drawn = random.SystemRandom().getrandbits(63) if seed is None and rng is None else None
        self._start_rng: str | None = None
        self._rng: random.Random | None = None
        self._addresses: list[Address | None] = []
        self._exhausted = False

    def config(self) -> dict[str, Any]:
        return {
            "bufsize": self.bufsize,
            "initial": self.initial,
            "seed": describe(self.seed),
            "reshuffle_each_epoch": self.reshuffle_each_epoch,
        }

    def _epoch_rng(self, ctx: Context) -> random.Random:
        if self.rng is not None:
            return self.rng
        seed = self.seed if self.seed is not None else self._drawn
        if ctx.epoch == 0 or not self.reshuffle_each_epoch:
            return random.Random(seed)  # epoch 0 draws exactly what webdataset draws for a seed
        return random.Random(make_seed(seed, ctx.epoch))

    def drawn_seed(self) -> Any:
        return self._drawn

    def adopt_seed(self, seed: Any) -> None:
        if self.seed is None and self.rng is None:
            self._drawn = seed

    def epoch_start_state(self) -> dict[str, Any]:
        return {"rng": self._start_rng}

    def state_dict(self) -> dict[str, Any]:
        if None in self._addresses:
            raise StateMismatchError(
                f"cannot save stage {self.index} (shuffle): it holds items whose position in the shards is unknown "
                "(a stage before it merges items, e.g. batched); shuffle before batching"
            )
        return {
            "rng": pack_rng(self._rng) if self._rng is not None else None,
            "buffer": pack_addresses(self._addresses),  # type: ignore[arg-type]
            "exhausted": self._exhausted,
        }

    def addresses(self) -> list[Address]:
        return [address for address in self._addresses if address is not None]

    def replay(self, src: Iterator[Any]) -> Iterator[Any]:
        return src  # a permutation: each item stays what it was

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        # Set up now, not when the generator first runs: a state taken before then must already be whole.
        rng = unpack_rng(state["rng"]) if state is not None and state.get("rng") is not None else self._epoch_rng(ctx)
        self._start_rng = pack_rng(rng)
        self._rng = rng
        self._addresses = []
        self._exhausted = bool(state and state.get("exhausted"))
        return self._shuffle(ctx, src, state, rng)

    def _shuffle(
        self, ctx: Context, src: Iterator[Any], state: dict[str, Any] | None, rng: random.Random
    ) -> Iterator[Any]:
        buf: list[Any] = []
        addresses = self._addresses
        if state is not None and state.get("buffer"):
            restored = unpack_addresses(state["buffer"])
            buf.extend(ctx.rematerializers[self.index](restored) if restored else [])
            addresses.extend(restored)
        tracker = AddressTracker(ctx)
        initial = min(self.initial, self.bufsize)
        src = iter(src)
        if not self._exhausted:
            for sample in src:
                buf.append(sample)
                addresses.append(tracker.address())
                if len(buf) < self.bufsize:
                    try:
                        buf.append(next(src))
                        addresses.append(tracker.address())
                    except StopIteration:
                        pass
                if len(buf) >= initial:
                    yield self._pick(ctx, buf, addresses, rng)
        self._exhausted = True
        while buf:
            yield self._pick(ctx, buf, addresses, rng)

    @staticmethod
    def _pick(ctx: Context, buf: list[Any], addresses: list[Address | None], rng: random.Random) -> Any:
        k = rng.randint(0, len(buf) - 1)
        sample, address = buf[k], addresses[k]
        buf[k], addresses[k] = buf[-1], addresses[-1]
        buf.pop()
        addresses.pop()
        if address is not None:
            ctx.stamp(address)
        else:
            ctx.provenance = None
        return sample


class detshuffle(shuffle):
    """webdataset's ``detshuffle``: a buffer shuffle seeded with ``seed + epoch``.

    The epoch is the pipeline's (see ``DataPipeline.set_epoch``), so it advances in
    non-persistent DataLoader workers too.
    """

    def __init__(self, bufsize: int = 1000, initial: int = 100, seed: Any = 0, epoch: int = -1):
        super().__init__(bufsize, initial)
        self._drawn = None  # seeded by seed + epoch: nothing drawn, nothing to carry in states
        self.detseed = seed
        self.epoch = epoch

    def adopt_seed(self, seed: Any) -> None:
        pass

    def config(self) -> dict[str, Any]:
        return {"bufsize": self.bufsize, "initial": self.initial, "seed": self.detseed, "epoch": self.epoch}

    def _epoch_rng(self, ctx: Context) -> random.Random:
        rng = random.Random()
        rng.seed(self.detseed + self.epoch + 1 + ctx.epoch)
        return rng


class batched(Stage):
    """Group items into batches of ``batchsize`` (collated with ``collation_fn``), as webdataset's.

    A batch is handed out as soon as it is full, so between two batches nothing is held;
    the partial batch at a checkpoint (if batching is not the last stage) is saved as addresses.
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
            raise StateMismatchError(f"cannot save stage {self.index} (batched): its partial batch has no positions")
        return {"partial": pack_addresses(self._addresses)}  # type: ignore[arg-type]

    def addresses(self) -> list[Address]:
        return [address for address in self._addresses if address is not None]

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        self._addresses = unpack_addresses(state["partial"]) if state else []  # type: ignore[assignment]
        return self._batches(ctx, src)

    def _batches(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        addresses = self._addresses
        batch: list[Any] = ctx.rematerializers[self.index](list(addresses)) if addresses else []  # type: ignore[arg-type]
        tracker = AddressTracker(ctx)
        for sample in src:
            batch.append(sample)
            addresses.append(tracker.address())
            if len(batch) >= self.batchsize:
                out = self._emit(ctx, batch)
                batch.clear()  # before handing it out: a checkpoint taken now holds no partial batch
                addresses.clear()
                yield out
        if batch and (len(batch) == self.batchsize or self.partial):
            out = self._emit(ctx, batch)
            batch.clear()
            addresses.clear()
            yield out

    def _emit(self, ctx: Context, batch: list[Any]) -> Any:
        ctx.provenance = None  # a batch has many sources: stages after it cannot address it
        if self.collation_fn is None:
            return list(batch)
        if self.collation_fn in (default_collation_fn, llm.collate_sequences) and llm.is_sequence(batch[0]):
            collated = llm.collate_sequences(list(batch))  # webdataset's collation cannot stack cu_seqlens
            llm.collated_here(collated)
            return collated
        return self.collation_fn(list(batch))


class _Splitter(Stage):
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
            raise StateMismatchError(
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
            if address is None:
                ctx.provenance = None
            else:  # item `position` of what replaying the stages up to here makes of the group's source
                ctx.stamp((*address[:-1], address[-1] + position))
            yield items[position]
        self._pending = 0


class unbatched(_Splitter):
    """Split collated batches (tuples/lists of columns, or dicts of columns) back into items."""

    def split(self, sample: Any) -> list[Any]:
        if isinstance(sample, (list, tuple)):
            return [tuple(x[i] for x in sample) for i in range(len(sample[0]))]
        if llm.is_sequence_batch(sample):  # (batch-level cu_seqlens/max_seqlen do not split by row)
            return llm.split_sequence_batch(sample)
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


class slice(Stage):
    """``itertools.islice`` over the items, with the count of items seen kept in the state."""

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
