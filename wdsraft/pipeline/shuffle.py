"""``shuffle`` and ``detshuffle``: webdataset's buffer shuffle, checkpointable.

They produce exactly webdataset's streams for the same seeds; shuffles reshuffle every
epoch (``reshuffle_each_epoch=False`` gives webdataset's same-order-every-epoch behaviour).
The buffer is saved as the addresses of the items it holds, re-read on restore.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, cast

from wdsraft.core.distributed import worker_info
from wdsraft.core.state import describe, make_seed, pack_rng, unpack_rng
from wdsraft.pipeline.addresses import Address, pack_addresses, unpack_addresses
from wdsraft.pipeline.stage import AddressTracker, Context, Curried, Stage, note_plain_run, unresumable_state


class shuffle(Curried, Stage):
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
        if self.rng is not None:
            # A live RNG goes on from one epoch to the next: the state of every epoch, even one taken between
            # two, carries where it is, so a restored pipeline's later epochs draw what the saved run's drew.
            return {"live_rng": pack_rng(self.rng)}
        return self._drawn

    def adopt_seed(self, seed: Any) -> None:
        if self.rng is not None:
            if isinstance(seed, dict) and seed.get("live_rng") is not None:
                self.rng.setstate(unpack_rng(seed["live_rng"]).getstate())
        elif self.seed is None:
            self._drawn = seed

    def epoch_start_state(self) -> dict[str, Any]:
        return {"rng": self._start_rng}

    def state_dict(self) -> dict[str, Any]:
        if None in self._addresses:
            return unresumable_state(
                f"cannot save stage {self.index} ({type(self).__name__}): it holds items whose position in the "
                "shards is unknown (a stage before it merges items, e.g. batched, or the pipeline's reader gives "
                "no positions); shuffle before batching"
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
        if state is not None and state.get("rng") is not None:
            rng = unpack_rng(state["rng"])
            if self.rng is not None:  # the live RNG itself goes on from there (later epochs draw from it)
                self.rng.setstate(rng.getstate())
                rng = self.rng
        else:
            rng = self._epoch_rng(ctx)
        self._start_rng = pack_rng(rng)
        self._rng = rng
        # (the restored buffer's addresses too: its items are re-read when the generator first runs)
        self._addresses = list(unpack_addresses(state["buffer"])) if state is not None and state.get("buffer") else []
        self._exhausted = bool(state and state.get("exhausted"))
        return self._shuffle(ctx, src, rng)

    def _shuffle(self, ctx: Context, src: Iterator[Any], rng: random.Random) -> Iterator[Any]:
        addresses = self._addresses
        restored = cast(list[Address], list(addresses))  # (only restored ones yet: each has its position)
        buf: list[Any] = ctx.rematerializers[self.index](restored) if restored else []
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
                    sample, address = self._pick(buf, addresses, rng)
                    upstream = ctx.hand_out(address)  # the item goes out with the address it came in with
                    yield sample
                    ctx.resume(upstream)
        self._exhausted = True
        while buf:
            sample, address = self._pick(buf, addresses, rng)
            upstream = ctx.hand_out(address)
            yield sample
            ctx.resume(upstream)

    @staticmethod
    def _pick(buf: list[Any], addresses: list[Address | None], rng: random.Random) -> tuple[Any, Address | None]:
        k = rng.randint(0, len(buf) - 1)
        sample, address = buf[k], addresses[k]
        buf[k], addresses[k] = buf[-1], addresses[-1]
        buf.pop()
        addresses.pop()
        return sample, address


class detshuffle(shuffle):
    """webdataset's ``detshuffle``: a buffer shuffle seeded with ``seed + epoch``.

    The epoch is the pipeline's (see ``DataPipeline.set_epoch``), so it advances in
    non-persistent DataLoader workers too. As in webdataset, ``.seed`` is the seed and
    ``.epoch`` the epoch of the last run (``epoch`` as given before the first): each run
    sets it to ``epoch + 1 + the pipeline's epoch`` and seeds the RNG with ``seed + .epoch``.
    Called on its own (``stage(src)``, as webdataset calls stages), each call runs the next epoch.
    """

    def __init__(self, bufsize: int = 1000, initial: int = 100, seed: Any = 0, epoch: int = -1):
        super().__init__(bufsize, initial)
        self._drawn = None  # seeded by seed + epoch: nothing drawn, nothing to carry in states
        self.seed = seed
        self.epoch = epoch
        self.start_epoch = epoch  # the configured epoch (``.epoch`` moves with every run)

    @property
    def detseed(self) -> Any:
        """The seed (an earlier name of ``seed``)."""
        return self.seed

    @detseed.setter
    def detseed(self, seed: Any) -> None:
        self.seed = seed

    def adopt_seed(self, seed: Any) -> None:
        pass

    def config(self) -> dict[str, Any]:
        return {"bufsize": self.bufsize, "initial": self.initial, "seed": self.seed, "epoch": self.start_epoch}

    def _epoch_rng(self, ctx: Context) -> random.Random:
        rng = random.Random()
        rng.seed(self.seed + self.epoch)
        return rng

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        self.epoch = self.start_epoch + 1 + ctx.epoch  # before the RNG is made: it is seeded from it
        return super().run(ctx, src, state)

    def __call__(self, src: Iterator[Any] | None = None) -> Iterator[Any]:
        # On its own, as webdataset's: each run is the next epoch after ``.epoch``.
        note_plain_run(type(self).__name__)
        return self.run(Context(self.epoch - self.start_epoch, worker_info()), src, None)


def _shuffle(
    data: Iterator[Any],
    bufsize: int = 1000,
    initial: int = 100,
    rng: random.Random | None = None,
    seed: Any = None,
    handler: Any = None,
) -> Iterator[Any]:
    """webdataset's ``_shuffle`` (the function its ``shuffle`` curries), run by :class:`shuffle`: the same
    stream for the same ``rng`` or ``seed``, and the same draws from a given ``rng``. Without state."""
    yield from shuffle(bufsize, initial, rng=rng, seed=seed, handler=handler)(data)


shuffle.f = staticmethod(_shuffle)
