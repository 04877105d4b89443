"""LLM stages: tokenize, add BOS/EOS, and cut or pack token streams into fixed-length sequences.

The stage names are epochraft's: ``tokenize``, ``ensure_bos_eos``, ``concat_chunk``,
``chunk``, ``pad``, plus ``pack_bestfit``. Every stage that holds tokens between two
outputs is checkpointable: it saves *where* the tokens came from (the document's position
in the shards and a token offset), not the tokens, and re-tokenizes on restore.

Each emitted sequence is a dict of torch tensors of length ``n`` -- ``input_ids``,
``labels`` (-100 on padding), ``attention_mask``, ``position_ids`` (restarting at every
document) -- plus ``cu_seqlens`` (document boundaries for variable-length attention) and
``__provenance__``: one ``[shard, ordinal, offset, token_start, token_end, is_last]`` per
document piece it holds, which is what the ledger records as consumed.
"""

from __future__ import annotations

import array
import bisect
import collections
import functools
import hashlib
import itertools
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from wdsraft.core.errors import StateMismatchError
from wdsraft.core.state import describe
from wdsraft.pipeline.addresses import Address, pack_addresses, unpack_addresses
from wdsraft.pipeline.stage import AddressTracker, Context, Stage, in_dataloader_worker

__all__ = [
    "Chunk",
    "ConcatChunk",
    "PackBestFit",
    "Tokenize",
    "as_tokenizer",
    "chunk",
    "collate_sequences",
    "concat_chunk",
    "ensure_bos_eos",
    "pack_bestfit",
    "pad",
    "tokenize",
]

TOKENS = "input_ids"
SEQUENCE_TENSORS = (TOKENS, "labels", "attention_mask", "position_ids")  # the tensor fields of a sequence
TOKEN_START = "__token_start__"  # set by the reader for documents a ledger says were delivered in part
PROVENANCE = "__provenance__"
IGNORE_INDEX = -100
QUEUED_BATCHES = 2  # batches ``tokenize`` keeps queued on the tokenizer's threads while it hands one out

logger = logging.getLogger(__name__)


# -- tokenizers ------------------------------------------------------------------------------------


# Digests of tokenizer objects, so that the pipelines of one process built on one tokenizer compute
# it once (0.1 s for a fast cl100k_base).
_digests: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


def _digest_of(tokenizer: Any, compute: Callable[[], str | None]) -> str | None:
    try:
        return _digests[tokenizer]
    except KeyError:
        digest = _digests[tokenizer] = compute()
        return digest
    except TypeError:  # (an object without weak references, or unhashable: computed each time)
        return compute()


class TokenizerAdapter:
    """One interface over tiktoken, ``tokenizers`` and transformers: texts in, token id arrays out.

    ``submit`` starts encoding a batch on the adapter's own threads and returns a function
    that waits for the result, so a caller can keep the threads busy with the next batch
    while it hands out the last one (tokenizers release the GIL while they encode).
    """

    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    name = "?"

    @property
    def identity(self) -> str:
        """What a pipeline state records of the tokenizer: its name and a digest of what decides its ids
        (two tokenizers of one class and vocabulary size must not pass for each other on a resume).
        Computed once per adapter: a forked or spawned worker inherits it."""
        identity = self.__dict__.get("_identity")
        if identity is None:
            digest = self._digest()
            identity = self._identity = f"{self.name}:{digest}" if digest else self.name
        return identity

    def _digest(self) -> str | None:
        return None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if type(self).submit is TokenizerAdapter.submit:
            raise NotImplementedError(f"{type(self).__name__} implements neither encode_batch nor submit")
        return self.submit(texts)()

    def submit(self, texts: list[str]) -> Callable[[], list[np.ndarray]]:
        arrays = self.encode_batch(texts)  # (adapters without threads of their own encode right away)
        return lambda: arrays


class _ThreadedAdapter(TokenizerAdapter):
    """An adapter that encodes on threads of its own, created on first use in each process (pools do not
    cross into DataLoader workers): ``num_threads`` of them, by default as ``thread_count`` says.

    A batch is cut into one run of documents per thread, balanced by text length, and each run is
    encoded by one serial call that releases the GIL. Runs of the next batches wait in the pool's
    queue, so a thread whose run is done takes the next batch's instead of idling until the
    batch's stragglers finish (a parallel batch call idles its threads at the end of every batch).
    """

    num_threads: int | None = None
    _pool_lock = threading.Lock()  # (one for all adapters: a pool is made once per adapter and process)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            pool, owner = self.__dict__.get("_pool"), self.__dict__.get("_pool_pid")
            if pool is None or owner != os.getpid():  # a forked DataLoader worker has none of its parent's threads
                self._pool_threads = thread_count(self.num_threads)
                self._prepare_process()
                pool = self._pool = ThreadPoolExecutor(self._pool_threads, thread_name_prefix="wdsraft-tokenize")
                self._pool_pid = os.getpid()
            return pool

    def _prepare_process(self) -> None:
        """Called once in each process that encodes, before its first run."""

    def _encode_run(self, texts: list[str]) -> list[np.ndarray]:
        raise NotImplementedError

    def submit(self, texts: list[str]) -> Callable[[], list[np.ndarray]]:
        pool = self._executor()
        futures = [pool.submit(self._encode_run, run) for run in _balanced_runs(texts, self._pool_threads)]
        return lambda: [ids for future in futures for ids in future.result()]

    def __getstate__(self) -> dict[str, Any]:
        per_process = ("_pool", "_pool_pid", "_pool_threads")
        return {key: value for key, value in self.__dict__.items() if key not in per_process}


# A fork while another thread held the lock would leave it held in the child for good.
os.register_at_fork(after_in_child=lambda: setattr(_ThreadedAdapter, "_pool_lock", threading.Lock()))


def thread_count(requested: int | None) -> int:
    """``requested`` threads, or by default: one in a worker process (a DataLoader worker, or one that
    webdataset's ``NUM_WORKERS`` describes), where the workers are the parallelism;
    elsewhere the available cores, shared among the ranks on this node (``LOCAL_WORLD_SIZE``, set
    by torchrun; ranks that SLURM binds to their own cores see only those)."""
    if requested is not None:
        return max(1, requested)
    if in_dataloader_worker() or "NUM_WORKERS" in os.environ:
        return 1
    return max(1, available_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; a cgroup CPU quota is not counted)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


class TiktokenTokenizer(_ThreadedAdapter):
    """A tiktoken ``Encoding``: special-token text is encoded as ordinary text, as ``encode_ordinary``
    does, unless ``match_special_tokens`` (then ``<|endoftext|>`` in a text becomes its id).

    A run is encoded with ``encode_to_numpy`` (no Python list of ints per document).
    """

    def __init__(self, encoding: Any, num_threads: int | None = None, match_special_tokens: bool | None = None):
        self.encoding = encoding
        self.num_threads = num_threads
        self.match_special_tokens = bool(match_special_tokens)
        self.eos_id = encoding.eot_token
        self.name = f"tiktoken:{encoding.name}" + (":special-tokens-matched" if self.match_special_tokens else "")

    def _digest(self) -> str | None:
        return _digest_of(self.encoding, self._compute_digest)

    def _compute_digest(self) -> str | None:
        ranks = getattr(self.encoding, "_mergeable_ranks", None)
        specials = getattr(self.encoding, "_special_tokens", {})
        if ranks is None:  # (not tiktoken's own Encoding: its name is all there is)
            return None
        digest = hashlib.sha256(str(getattr(self.encoding, "_pat_str", "")).encode())
        for token, rank in ranks.items():
            digest.update(token)
            digest.update(rank.to_bytes(8, "little"))
        digest.update(json.dumps(sorted(specials.items())).encode())
        return digest.hexdigest()[:16]

    def _encode_run(self, texts: list[str]) -> list[np.ndarray]:
        encode = self.encoding.encode_to_numpy
        if self.match_special_tokens:
            return [encode(text, allowed_special="all") for text in texts]
        return [encode(text, disallowed_special=()) for text in texts]


def _balanced_runs(texts: list[str], count: int) -> list[list[str]]:
    """``texts`` cut into at most ``count`` consecutive runs of about equal total length."""
    if count <= 1 or len(texts) <= 1:
        return [texts] if texts else []
    ends = [0, *itertools.accumulate(map(len, texts))]  # ends[i]: length of texts[:i]
    cuts = []
    for k in range(1, count):
        target = ends[-1] * k / count
        cut = bisect.bisect_left(ends, target)  # the first end at or past the target, or the one before it
        cuts.append(cut - 1 if cut > 0 and target - ends[cut - 1] < ends[cut] - target else cut)
    bounds = sorted({0, *cuts, len(texts)})
    return [texts[a:b] for a, b in itertools.pairwise(bounds)]


class HFTokenizer(_ThreadedAdapter):
    """A ``tokenizers.Tokenizer`` or a transformers fast tokenizer (its Rust backend does the work).

    A run is one ``encode_batch_fast`` call, serial in the calling thread: ``_prepare_process`` sets
    the process's ``TOKENIZERS_PARALLELISM`` to ``false`` (in a DataLoader worker always, in the
    training process where unset). Left to its Rayon pool, the batch call idles the cores at the
    end of every batch, and batches submitted from several threads nest on Rayon's stacks, so
    results arrive in bursts.
    """

    def __init__(self, tokenizer: Any, num_threads: int | None = None, match_special_tokens: bool | None = None):
        self.backend = _private_backend(getattr(tokenizer, "backend_tokenizer", tokenizer), match_special_tokens)
        # (the Rust flag: special-token text encoded as text)
        self.special_tokens_as_text = bool(getattr(self.backend, "encode_special_tokens", False))
        self.num_threads = num_threads
        self.bos_id = getattr(tokenizer, "bos_token_id", None)
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        self.pad_id = getattr(tokenizer, "pad_token_id", None)
        # The flag is not in the serialized tokenizer the digest covers: the name carries it.
        self.name = f"hf:{type(tokenizer).__name__}:{self.backend.get_vocab_size()}"
        if self.special_tokens_as_text:
            self.name += ":special-tokens-as-text"

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if hasattr(self.backend, "encode_special_tokens"):  # (a Tokenizer pickles as its JSON, without the flag)
            self.backend.encode_special_tokens = self.special_tokens_as_text

    def _digest(self) -> str | None:
        # The whole serialized tokenizer (vocabulary, merges, normalizer, pre-tokenizer...): about 0.1 s
        # for cl100k_base, once per adapter (its backend is its own: later changes to yours do not reach it).
        return _digest_of(self.backend, lambda: hashlib.sha256(self.backend.to_str().encode()).hexdigest()[:16])

    def _prepare_process(self) -> None:
        # The Rust library reads the variable at every batch call; there is no other switch.
        current = os.environ.get("TOKENIZERS_PARALLELISM")
        parallel = current is not None and current.lower() not in ("", "off", "false", "f", "no", "n", "0")
        if in_dataloader_worker():
            # A worker's environment is its own. And a forked worker whose parent started the Rayon pool
            # with the variable set to true inherits a pool without threads: a parallel call there hangs.
            if current != "false":
                os.environ["TOKENIZERS_PARALLELISM"] = "false"
                logger.info("tokenize: TOKENIZERS_PARALLELISM=false in DataLoader worker process %d", os.getpid())
        elif current is None:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            logger.warning(
                "tokenize: set TOKENIZERS_PARALLELISM=false in this process (it encodes on %d threads of its own); "
                "this process's other fast-tokenizer batch calls now run on one core: set the variable yourself "
                "to choose",
                self._pool_threads,
            )
        elif parallel:
            logger.warning(
                "tokenize: TOKENIZERS_PARALLELISM=%s: each of tokenize's %d threads hands its run to the Rayon "
                "pool, which idles the cores at the end of every run; set it to false for tokenize's full speed",
                current,
                self._pool_threads,
            )

    def _encode_run(self, texts: list[str]) -> list[np.ndarray]:
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        # array.array takes the list of ids at C speed; numpy then wraps its buffer without a copy.
        return [
            np.frombuffer(array.array("I", e.ids), dtype=np.uint32) for e in encode(texts, add_special_tokens=False)
        ]


def _is_tiktoken(tokenizer: Any) -> bool:
    return hasattr(tokenizer, "encode_ordinary_batch") and hasattr(tokenizer, "eot_token")


def _private_backend(backend: Any, match_special_tokens: bool | None) -> Any:
    """A copy of a ``tokenizers.Tokenizer`` for tokenize alone, taken when the pipeline is built: settings
    made on the caller's object later (transformers sets ``encode_special_tokens`` on every call, truncation
    and padding on calls that ask for them) do not reach it. Truncation and padding are off in it (a
    document is encoded whole), and special-token text is matched or not as asked."""
    if not hasattr(backend, "to_str"):  # (another object with ``encode_batch``: used as it is)
        if match_special_tokens is not None:
            raise ValueError(f"match_special_tokens needs a tokenizers.Tokenizer, not {type(backend).__name__}")
        return backend
    from tokenizers import Tokenizer

    private = Tokenizer.from_str(backend.to_str())  # (about 0.5 s and 20 MB for cl100k_base)
    if backend.truncation is not None or backend.padding is not None:
        logger.warning("tokenize: the tokenizer's truncation and padding are not applied: documents are encoded whole")
    private.no_truncation()
    private.no_padding()
    as_text = backend.encode_special_tokens if match_special_tokens is None else not match_special_tokens
    private.encode_special_tokens = as_text
    return private


def as_tokenizer(
    tokenizer: Any, num_threads: int | None = None, match_special_tokens: bool | None = None
) -> TokenizerAdapter:
    """Wrap a tiktoken ``Encoding``, a ``tokenizers.Tokenizer`` or a transformers fast tokenizer.

    ``match_special_tokens``: whether special-token text in a document (``<|endoftext|>``) becomes the
    special token's id; by default each tokenizer's own rule (tiktoken: no, as ``encode_ordinary``;
    ``tokenizers``: yes, unless its ``encode_special_tokens`` is set).
    """
    if isinstance(tokenizer, TokenizerAdapter):
        if num_threads is not None or match_special_tokens is not None:
            raise ValueError("num_threads and match_special_tokens are settings of the adapter: set them on it")
        return tokenizer
    if _is_tiktoken(tokenizer):
        return TiktokenTokenizer(tokenizer, num_threads, match_special_tokens)
    if hasattr(tokenizer, "encode_batch") or hasattr(tokenizer, "backend_tokenizer"):
        return HFTokenizer(tokenizer, num_threads, match_special_tokens)
    raise TypeError(
        f"unsupported tokenizer {type(tokenizer).__name__}: pass a tiktoken Encoding, a tokenizers.Tokenizer "
        "or a transformers PreTrainedTokenizerFast"
    )


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


# -- tokenize --------------------------------------------------------------------------------------


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
            address = pending.pop(0)
            if address is not None:
                ctx.stamp(address)
            else:
                ctx.provenance = None
            yield item


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


# -- BOS/EOS ---------------------------------------------------------------------------------------


def _bos_eos_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """A tokenizer's BOS and EOS ids, as its adapter has them (without building one)."""
    if isinstance(tokenizer, TokenizerAdapter):
        return tokenizer.bos_id, tokenizer.eos_id
    if _is_tiktoken(tokenizer):  # (no BOS)
        return None, tokenizer.eot_token
    return getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)


class ensure_bos_eos:
    """Add BOS at the start and EOS at the end of each document where absent (epochraft's rule).

    When BOS and EOS are the same id, a document never gets two in a row. A stateless map:
    it holds nothing between items.
    """

    def __init__(self, tokenizer: Any = None, bos_id: int | None = None, eos_id: int | None = None):
        if tokenizer is not None:
            own_bos, own_eos = _bos_eos_ids(tokenizer)
            bos_id = own_bos if bos_id is None else bos_id
            eos_id = own_eos if eos_id is None else eos_id
        if bos_id is None and eos_id is None:
            raise ValueError("ensure_bos_eos: the tokenizer has neither BOS nor EOS; pass bos_id/eos_id")
        self.bos_id = bos_id
        self.eos_id = eos_id

    def add(self, ids: np.ndarray) -> np.ndarray:
        # BOS first, then EOS judged on the result: with BOS == EOS an empty document becomes [BOS]
        # (which already ends with EOS), never [BOS, EOS].
        n = len(ids)
        head = int(self.bos_id is not None and (n == 0 or ids[0] != self.bos_id))
        last = self.bos_id if head and n == 0 else (ids[-1] if n else None)
        tail = int(self.eos_id is not None and (last is None or last != self.eos_id))
        if not head and not tail:
            return ids
        out = np.empty(n + head + tail, dtype=ids.dtype)  # one allocation, not two concatenations
        if head:
            out[0] = self.bos_id
        out[head : head + n] = ids
        if tail:
            out[-1] = self.eos_id
        return out

    def __call__(self, src: Iterator[Any]) -> Iterator[Any]:
        for item in src:
            item[TOKENS] = self.add(_token_array(item[TOKENS]))
            yield item


# -- sequences -------------------------------------------------------------------------------------

Piece = tuple  # (tokens: np.ndarray, address, start, end, doc_length, position)


def _remaining(item: dict[str, Any]) -> tuple[np.ndarray, int]:
    """The tokens of a document still to deliver, and where they start in the whole document.

    A document that a ledger says was delivered in part before an elastic resume goes on
    where it stopped; token ranges always count in the whole document (BOS/EOS included).
    """
    start = item.get(TOKEN_START, 0)
    tokens = _token_array(item[TOKENS])
    return (tokens[start:], start) if start else (tokens, 0)


def _token_array(tokens: Any) -> np.ndarray:
    """Token ids as numpy (after a WebLoader, DataLoader's conversion has made them a torch tensor)."""
    return tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens


def _position(address: Address | None) -> list[Any]:
    return list(address[:-1]) if address is not None else [None, None, None]


def _document_position(item: Any, address: Address | None) -> list[Any]:
    """``[shard, ordinal, offset]`` of a document, for provenance: its own fields where it has them (after a
    ``WebLoader``, stages in the training process address items by loader batch), else its tar address."""
    if isinstance(item, dict) and "__url__" in item and "__ordinal__" in item:
        offset = item.get("__offset__")
        return [str(item["__url__"]), int(item["__ordinal__"]), None if offset is None else int(offset)]
    return _position(address)


def build_sequence(pieces: Sequence[Piece], length: int, pad_id: int) -> dict[str, Any]:
    """One training sequence from document pieces, padded to ``length``.

    The four tensors are rows of one ``[4, length]`` buffer (one allocation; batching copies
    rows), filled with a handful of whole-row numpy calls whatever the number of pieces:
    this runs thousands of times a second beside the tokenizer, on the same cores.
    """
    buffer = np.empty((len(SEQUENCE_TENSORS), length), dtype=np.int64)
    ids, labels, mask, positions = buffer
    sizes = [len(piece[0]) for piece in pieces]
    used = sum(sizes)
    if len(pieces) == 1:
        ids[:used] = pieces[0][0]
        positions[:used] = _arange(length)[:used]
    elif used:
        np.concatenate([piece[0] for piece in pieces], out=ids[:used])
        steps = _arange(length)
        np.concatenate([steps[:size] for size in sizes], out=positions[:used])  # restart at every piece
    labels[:used] = ids[:used]
    mask[:used] = 1
    buffer[:, used:] = _padding_column(pad_id)
    provenance = [[*position, start, end, end == total] for _, _, start, end, total, position in pieces]
    input_ids, labels_, attention_mask, position_ids = torch.from_numpy(buffer).unbind(0)
    return {
        TOKENS: input_ids,
        "labels": labels_,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "cu_seqlens": list(itertools.accumulate(sizes, initial=0)),
        PROVENANCE: provenance,
    }


_STEPS = np.arange(0, dtype=np.int64)


def _arange(size: int) -> np.ndarray:
    """0..size-1 (position ids), a read-only view of one shared array that grows as needed."""
    global _STEPS
    steps = _STEPS
    if len(steps) < size:
        steps = np.arange(max(size, 2 * len(steps)), dtype=np.int64)
        steps.flags.writeable = False
        _STEPS = steps  # (another thread growing it meanwhile is harmless: views of the old one stay valid)
    return steps[:size]


@functools.lru_cache(maxsize=8)
def _padding_column(pad_id: int) -> np.ndarray:
    """What a padding position holds in each of the four rows: pad id, ignored label, mask 0, position 0."""
    column = np.array([[pad_id], [IGNORE_INDEX], [0], [0]], dtype=np.int64)
    column.flags.writeable = False
    return column


class _SequenceStage(Stage):
    """Shared machinery: tracks document addresses and saves held pieces as (address, start, end)."""

    def __init__(self, length: int, pad_id: int = 0):
        if length < 1:
            raise ValueError("sequence length must be positive")
        self.length = length
        self.pad_id = pad_id
        self._held: list[Piece] = []  # pieces received and not yet handed out, in order

    def config(self) -> dict[str, Any]:
        return {"length": self.length, "pad_id": self.pad_id}

    def _save(self, pieces: Sequence[Piece]) -> dict[str, Any]:
        if any(piece[1] is None for piece in pieces):
            raise StateMismatchError(f"cannot save stage {self.index}: it holds documents without positions")
        return {
            "docs": pack_addresses([piece[1] for piece in pieces]),
            "spans": [[piece[2], piece[3]] for piece in pieces],
        }

    def _restore(self, ctx: Context, saved: dict[str, Any]) -> list[Piece]:
        addresses = unpack_addresses(saved["docs"])
        if not addresses:
            return []
        unique = list(dict.fromkeys(addresses))
        documents = dict(zip(unique, ctx.rematerializers[self.index](unique), strict=True))
        pieces = []
        for address, (start, end) in zip(addresses, saved["spans"], strict=True):
            document = documents[address]
            tokens = document[TOKENS]
            pieces.append((tokens[start:end], address, start, end, len(tokens), _document_position(document, address)))
        return pieces

    def addresses(self) -> list[Address]:
        return [piece[1] for piece in self._held if piece[1] is not None]

    def state_dict(self) -> dict[str, Any]:
        return self._save(self._held)

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        self._saved = state  # adopted by _run, which re-reads the held documents on its first step
        self._held = []
        return self._run(ctx, src)

    def _run(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        raise NotImplementedError

    def _sequence(self, pieces: Sequence[Piece]) -> dict[str, Any]:
        return build_sequence(pieces, self.length, self.pad_id)

    def _emit(self, ctx: Context, pieces: Sequence[Piece]) -> dict[str, Any]:
        ctx.provenance = None  # a sequence has many sources: later stages cannot address it
        return self._sequence(pieces)


class ConcatChunk(_SequenceStage):
    """Concatenate documents and cut the stream into sequences of ``length`` tokens.

    Nothing is dropped: the tokens left at the end of the input form a last, padded
    sequence. Between outputs the stage holds the unfinished tail of the stream, saved as
    (document address, token range).
    """

    def _run(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        held = self._held
        if self._saved is not None:
            held.extend(self._restore(ctx, self._saved))
        # A state taken inside a long document holds a full sequence or more: hand those out first
        # (the input may have nothing more to give).
        total = yield from self._full_sequences(ctx, held, sum(len(piece[0]) for piece in held))
        tracker = AddressTracker(ctx)
        for item in src:
            tokens, base = _remaining(item)
            address = tracker.address()
            end = base + len(tokens)
            held.append((tokens, address, base, end, end, _document_position(item, address)))
            total = yield from self._full_sequences(ctx, held, total + len(tokens))
        if held and total > 0:
            out = list(held)
            held.clear()
            yield self._emit(ctx, out)
        held.clear()  # (empty documents after the last sequence: nothing to hand out, nothing to re-read)

    def _full_sequences(self, ctx: Context, held: list[Piece], total: int) -> Generator[Any, None, int]:
        """Hand out every full sequence the held tokens (``total`` of them) make; returns what is left."""
        while total >= self.length:
            out, rest = _take(held, self.length)
            held[:] = rest
            total -= self.length
            yield self._emit(ctx, out)
        return total


def _take(pieces: list[Piece], count: int) -> tuple[list[Piece], list[Piece]]:
    """Split a list of pieces after ``count`` tokens."""
    taken: list[Piece] = []
    for i, piece in enumerate(pieces):
        tokens, address, start, end, total, position = piece
        if count >= len(tokens):
            taken.append(piece)
            count -= len(tokens)
            if count == 0:
                return taken, pieces[i + 1 :]
            continue
        taken.append((tokens[:count], address, start, start + count, total, position))
        rest = [(tokens[count:], address, start + count, end, total, position), *pieces[i + 1 :]]
        return taken, rest
    return taken, []


class Chunk(_SequenceStage):
    """One document per sequence: cut each document into pieces of ``length`` tokens.

    The last piece of a document, shorter than ``length``, is dropped with
    ``drop_remainder=True`` (the default) and padded otherwise.
    """

    def __init__(self, length: int, drop_remainder: bool = True, pad_id: int = 0):
        super().__init__(length, pad_id)
        self.drop_remainder = drop_remainder

    def config(self) -> dict[str, Any]:
        return {**super().config(), "drop_remainder": self.drop_remainder}

    def _run(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        if self._saved is not None:
            self._held.extend(self._restore(ctx, self._saved))
            yield from self._cut(ctx)
        tracker = AddressTracker(ctx)
        for item in src:
            tokens, base = _remaining(item)
            address = tracker.address()
            end = base + len(tokens)
            self._held.append((tokens, address, base, end, end, _document_position(item, address)))
            yield from self._cut(ctx)

    def _cut(self, ctx: Context) -> Iterator[Any]:
        while self._held:
            tokens, address, start, end, total, position = self._held[0]
            if len(tokens) >= self.length:
                piece = (tokens[: self.length], address, start, start + self.length, total, position)
                rest = (tokens[self.length :], address, start + self.length, end, total, position)
                self._held[0] = rest
                if len(rest[0]) == 0:
                    self._held.pop(0)
                yield self._emit(ctx, [piece])
            else:
                self._held.pop(0)
                if len(tokens) and not self.drop_remainder:
                    yield self._emit(ctx, [(tokens, address, start, end, total, position)])


class pad:
    """One document per sequence, truncated to ``length`` and padded (supervised fine-tuning).

    A stateless map: it holds nothing between items. A document is consumed by its sequence,
    truncated tail included: its provenance says ``is_last`` even when the tail was cut off.
    """

    def __init__(self, length: int, pad_id: int = 0):
        self.length = length
        self.pad_id = pad_id

    def __call__(self, src: Iterator[Any]) -> Iterator[Any]:
        for item in src:
            tokens, base = _remaining(item)
            kept = tokens[: self.length]
            address = _item_address(item)
            # The document is consumed with this sequence, truncated tail included: pad drops it by design.
            end = base + len(kept)
            piece = (kept, address, base, end, end, _document_position(item, address))
            if len(kept):  # (an empty document, possible without ensure_bos_eos, makes no sequence)
                yield build_sequence([piece], self.length, self.pad_id)


def _item_address(item: dict[str, Any]) -> Address | None:
    if "__url__" in item and "__ordinal__" in item:
        return (item["__url__"], item["__ordinal__"], item.get("__offset__"), 0)  # (a map may have dropped it)
    return None


class PackBestFit(_SequenceStage):
    """Pack whole documents into sequences with best-fit-decreasing over a buffer of documents.

    Documents longer than ``length`` are split into full sequences and a remainder; no
    other document is cut. When ``buffer`` documents are held, they are packed: longest
    first, each into the open sequence with the least room that still fits it. This wastes
    a little padding instead of cutting documents in two as ``concat_chunk`` does.
    """

    def __init__(self, length: int, buffer: int = 1024, pad_id: int = 0):
        super().__init__(length, pad_id)
        self.buffer = buffer
        self._ready: list[list[Piece]] = []  # packed sequences not yet handed out

    def config(self) -> dict[str, Any]:
        return {**super().config(), "buffer": self.buffer}

    def state_dict(self) -> dict[str, Any]:
        # Packed sequences not yet handed out: their pieces in one record, and how many each holds.
        pieces = [piece for sequence in self._ready for piece in sequence]
        sizes = [len(sequence) for sequence in self._ready]
        return {"ready": self._save(pieces), "ready_sizes": sizes, "held": self._save(self._held)}

    def addresses(self) -> list[Address]:
        return super().addresses() + [p[1] for sequence in self._ready for p in sequence if p[1] is not None]

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        self._saved = state
        self._held = []
        self._ready = []
        return self._run(ctx, src)

    def _run(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        if self._saved is not None:
            pieces = iter(self._restore(ctx, self._saved["ready"]))
            self._ready.extend([next(pieces) for _ in range(size)] for size in self._saved["ready_sizes"])
            self._held.extend(self._restore(ctx, self._saved["held"]))
            yield from self._hand_out(ctx)
        tracker = AddressTracker(ctx)
        n = self.length
        for item in src:
            tokens, base = _remaining(item)
            address = tracker.address()
            position = _document_position(item, address)
            end = base + len(tokens)
            full = len(tokens) // n if len(tokens) > n else 0
            for k in range(full):  # a long document: full sequences first, the rest is packed
                piece = (tokens[k * n : (k + 1) * n], address, base + k * n, base + (k + 1) * n, end, position)
                self._ready.append([piece])
            if len(tokens) - full * n > 0 or len(tokens) == 0:
                self._held.append((tokens[full * n :], address, base + full * n, end, end, position))
            if len(self._held) >= self.buffer:
                self._pack_held(final=False)
            yield from self._hand_out(ctx)
        if self._held:
            self._pack_held(final=True)
        yield from self._hand_out(ctx)

    def _pack_held(self, final: bool) -> None:
        held, self._held = self._held, []
        for sequence in self._pack(held):
            if any(len(piece[0]) for piece in sequence):
                self._ready.append(sequence)
            elif not final:  # empty documents only: they wait to ride along in a sequence with tokens
                self._held.extend(sequence)

    def _hand_out(self, ctx: Context) -> Iterator[Any]:
        while self._ready:
            sequence = self._ready.pop(0)
            yield self._emit(ctx, sequence)

    def _pack(self, pieces: list[Piece]) -> list[list[Piece]]:
        """Best-fit decreasing; ties broken by arrival order, so packing is deterministic."""
        order = sorted(range(len(pieces)), key=lambda i: (-len(pieces[i][0]), i))
        bins: list[list[Piece]] = []
        room: list[tuple[int, int]] = []  # (free tokens, bin number), sorted
        for i in order:
            size = len(pieces[i][0])
            slot = bisect.bisect_left(room, (size, -1))
            if slot < len(room):
                free, number = room.pop(slot)
                bins[number].append(pieces[i])
                bisect.insort(room, (free - size, number))
            else:
                bins.append([pieces[i]])
                bisect.insort(room, (self.length - size, len(bins) - 1))
        return bins


def concat_chunk(length: int, pad_id: int = 0) -> ConcatChunk:
    return ConcatChunk(length, pad_id)


def chunk(length: int, drop_remainder: bool = True, pad_id: int = 0) -> Chunk:
    return Chunk(length, drop_remainder, pad_id)


def pack_bestfit(length: int, buffer: int = 1024, pad_id: int = 0) -> PackBestFit:
    return PackBestFit(length, buffer, pad_id)


def builds_sequences(stage: Any) -> bool:
    """Whether ``stage`` is one of the stages that make sequences with ``build_sequence`` (exactly: a
    subclass may change what they hold)."""
    return type(stage) in (ConcatChunk, Chunk, PackBestFit, pad)


def is_sequence(item: Any) -> bool:
    return isinstance(item, dict) and PROVENANCE in item and "cu_seqlens" in item


def is_sequence_batch(batch: Any) -> bool:
    """Whether ``batch`` is a batch ``collate_sequences`` made (``[batch, length]`` token ids)."""
    return is_sequence(batch) and isinstance(batch.get(TOKENS), torch.Tensor) and batch[TOKENS].dim() == 2


def split_sequence_batch(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The sequences of a ``collate_sequences`` batch, as the sequence stages made them (rows are views),
    so that ``unbatched`` and ``batched`` can regroup them in the training process."""
    rows, length = batch[TOKENS].shape
    bounds = batch["cu_seqlens"].tolist()
    per_row = {key: value for key, value in batch.items() if key not in ("cu_seqlens", "max_seqlen")}
    sequences = []
    cursor = 1  # bounds[0] is the first row's start
    for row in range(rows):
        # A row holds one segment per document piece (its provenance says how many; pieces may be empty,
        # so values alone cannot tell rows apart), then a padding segment if the pieces end short of it.
        pieces = len(batch[PROVENANCE][row])
        row_bounds = [0, *(bound - row * length for bound in bounds[cursor : cursor + pieces])]
        cursor += pieces + (row_bounds[-1] < length)
        sequence = {key: value[row] for key, value in per_row.items()}
        sequence["cu_seqlens"] = row_bounds
        sequences.append(sequence)
    return sequences


def collate_sequences(sequences: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack sequences into a batch of ``[batch, length]`` tensors, with batch-level ``cu_seqlens``
    and ``max_seqlen`` for variable-length attention over the flattened batch (flash-attn's
    convention). ``batched`` uses it for sequences by default.

    The four tensors are views of one buffer. ``max_seqlen`` covers every segment of
    ``cu_seqlens``, padding segments included (varlen kernels size their work by it).
    """
    length = sequences[0][TOKENS].shape[0]
    buffer = torch.empty((len(SEQUENCE_TENSORS), len(sequences), length), dtype=torch.int64)
    for field, key in enumerate(SEQUENCE_TENSORS):
        torch.stack([s[key] for s in sequences], out=buffer[field])
    batch: dict[str, Any] = {key: buffer[field] for field, key in enumerate(SEQUENCE_TENSORS)}
    boundaries = [0]
    for row, sequence in enumerate(sequences):
        bounds = sequence["cu_seqlens"]
        boundaries.extend(row * length + b for b in bounds[1:])
        if bounds[-1] < length:  # padding forms its own segment, so rows stay aligned
            boundaries.append((row + 1) * length)
    batch["cu_seqlens"] = torch.tensor(boundaries, dtype=torch.int32)
    batch["max_seqlen"] = max((b - a for a, b in itertools.pairwise(boundaries)), default=0)
    batch[PROVENANCE] = [s[PROVENANCE] for s in sequences]
    return batch


# -- crossing from DataLoader workers --------------------------------------------------------------


class CompactSequenceBatch:
    """A batch of sequences on its way from a DataLoader worker to the training process.

    Of the four ``[batch, length]`` int64 tensors only the token ids travel (as int32): labels,
    attention mask and position ids follow from them, the batch's ``cu_seqlens`` and each
    row's real length, and are rebuilt on arrival (unpickling returns the full batch). A
    batch then crosses as one 64 KiB message instead of a 512 KiB shared-memory segment, whose
    file descriptor hand-over costs more than a millisecond of CPU per batch between the two
    processes: as much as tokenizing several documents.
    """

    def __init__(self, ids: np.ndarray, used: np.ndarray, rest: dict[str, Any]):
        self.ids = ids
        self.used = used
        self.rest = rest

    def __reduce__(self) -> tuple[Any, ...]:
        return (expand_sequence_batch, (self.ids, self.used, self.rest))


class _LastCollated(threading.local):
    batch: Any = None


_last_collated = _LastCollated()


def collated_here(batch: dict[str, Any]) -> None:
    """Note a batch ``batched`` just made with ``collate_sequences`` (the last one, in this thread)."""
    _last_collated.batch = batch


def straight_from_collation(batch: Any) -> bool:
    """Whether ``batch`` is the last batch ``batched`` collated in this thread (and forget it). The
    caller must know that no code ran on it since: see ``compat.convert_batch``."""
    last, _last_collated.batch = _last_collated.batch, None
    return last is batch


def compact_sequence_batch(batch: Any, unchanged: bool = False) -> CompactSequenceBatch | None:
    """The compact form of a batch made by ``collate_sequences``, or None when ``batch`` is not one.

    Checked in full (a batch changed after collation, labels included, travels as it is), unless
    the caller knows it is ``unchanged`` since ``collate_sequences`` made it.
    """
    if not (type(batch) is dict and all(isinstance(batch.get(key), torch.Tensor) for key in SEQUENCE_TENSORS)):
        return None
    cu_seqlens = batch.get("cu_seqlens")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        return None
    ids = batch[TOKENS]
    bounds = cu_seqlens.numpy()
    # Segments tiling every row from 0 to the end, as collate_sequences makes them (a map after batched
    # may have changed them; such a batch travels as it is).
    if ids.dim() != 2 or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != ids.numel() or (np.diff(bounds) < 0).any():
        return None
    if ids.numel() == 0 or any(
        batch[key].shape != ids.shape or batch[key].dtype != torch.int64 or batch[key].device.type != "cpu"
        for key in SEQUENCE_TENSORS
    ):
        return None
    low, high = torch.aminmax(ids)
    if low < np.iinfo(np.int32).min or high > np.iinfo(np.int32).max:
        return None
    used = batch["attention_mask"].sum(1).numpy().astype(np.int32)
    compact = ids.numpy().astype(np.int32)
    rest = {key: None if key in SEQUENCE_TENSORS else value for key, value in batch.items()}  # (keeps key order)
    rest["cu_seqlens"] = cu_seqlens.numpy()
    if not unchanged:
        expected = expand_sequence_batch(compact, used, rest)
        if not all(torch.equal(expected[key], batch[key]) for key in SEQUENCE_TENSORS[1:]):
            return None
    return CompactSequenceBatch(compact, used, rest)


def expand_sequence_batch(ids: np.ndarray, used: np.ndarray, rest: dict[str, Any]) -> dict[str, Any]:
    """The batch a ``CompactSequenceBatch`` stands for: the same tensors ``collate_sequences`` made."""
    rows, length = ids.shape
    buffer = np.empty((len(SEQUENCE_TENSORS), rows, length), dtype=np.int64)
    tokens, labels, mask, positions = buffer
    tokens[:] = ids
    real = _arange(length)[None, :] < used[:, None]
    mask[:] = real
    labels.fill(IGNORE_INDEX)
    np.copyto(labels, tokens, where=real)
    cu_seqlens = np.asarray(rest["cu_seqlens"], dtype=np.int64)
    flat = positions.reshape(-1)  # position ids restart at every segment boundary; padding holds 0
    np.subtract(_arange(rows * length), np.repeat(cu_seqlens[:-1], np.diff(cu_seqlens)), out=flat)
    np.copyto(positions, 0, where=~real)
    batch = dict(rest)
    batch.update(zip(SEQUENCE_TENSORS, torch.from_numpy(buffer).unbind(0), strict=True))
    batch["cu_seqlens"] = torch.from_numpy(rest["cu_seqlens"])
    return batch


def hf_from_tiktoken(vocab_file: str, special_tokens: dict[str, int] | None = None) -> Any:
    """A transformers fast tokenizer that encodes exactly like a tiktoken BPE file (e.g. cl100k_base).

    transformers' converter splits text with Oniguruma, which reads tiktoken's possessive
    quantifiers (``\\p{N}{1,3}+``) as repetitions; its default, non-possessive pattern gives
    the same pieces. Special tokens keep tiktoken's ids (cl100k's ``<|endoftext|>`` is 100257,
    after a gap) by filling gaps with placeholders.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=vocab_file).converted()
    specials = special_tokens or {"<|endoftext|>": 100257}
    for token, wanted in sorted(specials.items(), key=lambda item: item[1]):
        while backend.get_vocab_size() < wanted:
            backend.add_special_tokens([f"<|placeholder{backend.get_vocab_size()}|>"])
        backend.add_special_tokens([token])
        if backend.token_to_id(token) != wanted:
            raise ValueError(f"cannot place {token} at id {wanted}")
    eos = "<|endoftext|>" if "<|endoftext|>" in specials else None
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos)
