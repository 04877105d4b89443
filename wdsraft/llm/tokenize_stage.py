"""The ``tokenize`` stage: adds ``input_ids`` to each sample, encoding batches of documents on the
tokenizer's threads while earlier batches are handed out.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from wdsraft.core.errors import StateMismatchError
from wdsraft.core.state import describe
from wdsraft.llm.sequences import TOKENS
from wdsraft.llm.tokenizers import as_tokenizer
from wdsraft.pipeline.addresses import Address, pack_addresses, unpack_addresses
from wdsraft.pipeline.stage import AddressTracker, Context, Stage

QUEUED_BATCHES = 2  # batches ``tokenize`` keeps queued on the tokenizer's threads while it hands one out


logger = logging.getLogger(__name__)


class TextField:
    """Where a sample's text is: a field (``"txt"``) or a field of a JSON field (``"json:text"``).

    A class, not a closure, so that a pipeline pickles into spawned or forkserver DataLoader workers.
    """

    def __init__(self, spec: str):
        self.field, _, self.inner = spec.partition(":")

    def __call__(self, sample: Any) -> str:
        value = sample[self.field]
        if self.inner:
            value = (json.loads(value) if isinstance(value, (bytes, str)) else value)[self.inner]
        return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


def text_getter(text: str | Callable[[Any], str]) -> Callable[[Any], str]:
    """A sample's text: ``text`` itself when it is a function, else the field it names (``TextField``)."""
    return text if callable(text) else TextField(text)


class Tokenize(Stage):
    """Tokenize documents in batches on the adapter's threads (one serial run per thread); order is kept.

    Adds ``input_ids`` (a uint32 numpy array) to each sample. Holds up to ``QUEUED_BATCHES + 1``
    batches between outputs: its state is the addresses of the documents not yet handed out.
    """

    def __init__(
        self,
        tokenizer: Any,
        text: str | Callable[[Any], str] = "txt",
        batch_size: int = 64,
        num_threads: int | None = None,
        match_special_tokens: bool | None = None,
    ):
        self.tokenizer = as_tokenizer(tokenizer, num_threads, match_special_tokens)
        self.text = text
        self.get_text = text_getter(text)
        self.batch_size = batch_size
        self._pending: list[Address | None] = []

    def config(self) -> dict[str, Any]:
        # A function is described by its name, not its repr (an address that differs in every process).
        return {"tokenizer": self.tokenizer.identity, "text": describe(self.text), "batch_size": self.batch_size}

    def _tokenized(self, samples: list[Any]) -> list[Any]:
        return self._with_ids(samples, self.tokenizer.encode_batch([self.get_text(sample) for sample in samples]))

    @staticmethod
    def _with_ids(samples: list[Any], arrays: list[np.ndarray]) -> list[Any]:
        out = []
        for sample, ids in zip(samples, arrays, strict=True):
            item = dict(sample) if isinstance(sample, dict) else {"sample": sample}
            item[TOKENS] = ids  # (whole: a ledger's token counts apply after BOS/EOS, in the sequence stages)
            out.append(item)
        return out

    def replay(self, src: Iterator[Any]) -> Iterator[Any]:
        for sample in src:
            yield from self._tokenized([sample])

    def state_dict(self) -> dict[str, Any]:
        if None in self._pending:
            raise StateMismatchError(f"cannot save stage {self.index} (tokenize): documents without positions")
        return {"pending": pack_addresses(self._pending)}  # type: ignore[arg-type]

    def addresses(self) -> list[Address]:
        return [address for address in self._pending if address is not None]

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        self._pending = unpack_addresses(state["pending"]) if state else []  # type: ignore[assignment]
        return self._run(ctx, src)

    def _run(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        pending = self._pending
        if pending:  # restored: re-read and re-tokenize the documents the batch still held
            documents = ctx.rematerializers[self.index](list(pending))  # type: ignore[arg-type]
            yield from self._hand_out(ctx, self._tokenized(documents), pending)
        tracker = AddressTracker(ctx)
        src = iter(src)

        def take() -> list[Any]:
            batch = []
            for sample in src:
                batch.append(sample)
                pending.append(tracker.address())
                if len(batch) >= self.batch_size:
                    break
            return batch

        # While this stage hands one batch out (and the stages after it pack it), QUEUED_BATCHES more
        # are queued on the tokenizer's threads: with one, the threads idled at the end of each batch
        # (a thread whose share is done waits for the stragglers) about 5 % of the time on 2 cores.
        in_flight: collections.deque[tuple[list[Any], Callable[[], list[np.ndarray]]]] = collections.deque()
        exhausted = False
        while True:
            while not exhausted and len(in_flight) <= QUEUED_BATCHES:
                batch = take()
                if batch:
                    in_flight.append((batch, self.tokenizer.submit([self.get_text(sample) for sample in batch])))
                exhausted = len(batch) < self.batch_size
            if not in_flight:
                return
            batch, result = in_flight.popleft()
            yield from self._hand_out(ctx, self._with_ids(batch, result()), pending)

    @staticmethod
    def _hand_out(ctx: Context, items: list[Any], pending: list[Address | None]) -> Iterator[Any]:
        for item in items:
            upstream = ctx.hand_out(pending.pop(0))
            yield item
            ctx.resume(upstream)


def tokenize(
    tokenizer: Any,
    text: str | Callable[[Any], str] = "txt",
    batch_size: int = 64,
    num_threads: int | None = None,
    match_special_tokens: bool | None = None,
) -> Tokenize:
    return Tokenize(
        tokenizer, text=text, batch_size=batch_size, num_threads=num_threads, match_special_tokens=match_special_tokens
    )
