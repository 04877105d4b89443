"""Tokenizer adapters: one interface over tiktoken and HuggingFace fast tokenizers, an identity
(digest) for state checks, and per-process thread pools that encode one balanced run of
documents per thread.
"""

from __future__ import annotations

import array
import bisect
import hashlib
import itertools
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from wdsraft.pipeline.stage import in_dataloader_worker

logger = logging.getLogger(__name__)


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
    #: How a state names the tokenizer (by default the adapter's class: two classes never pass for each other).
    name: str | None = None

    @property
    def identity(self) -> str:
        """What a pipeline state records of the tokenizer: its name and a digest of what decides its ids
        (two tokenizers of one class and vocabulary size must not pass for each other on a resume).
        Computed once per adapter: a forked or spawned worker inherits it."""
        identity = self.__dict__.get("_identity")
        if identity is None:
            # (a spawned worker imports the training script as __mp_main__: the same class, the same name)
            module = "__main__" if type(self).__module__ == "__mp_main__" else type(self).__module__
            name = self.name or f"{module}.{type(self).__qualname__}"
            digest = self._digest()
            if digest is None:
                logger.warning(
                    "tokenize: the tokenizer adapter %s gives no digest of its vocabulary (_digest): a resume with "
                    "another model behind the same adapter class would not be refused",
                    name,
                )
            identity = self._identity = f"{name}:{digest}" if digest else name
        return identity

    def _digest(self) -> str | None:
        """A digest of what decides the ids (vocabulary, merges, normalization): override it in an adapter of
        your own, so that a state is refused under another model."""
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
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(backend, "encode_batch") and hasattr(backend, "to_str"):  # (a tokenizers.Tokenizer, or one inside)
        return HFTokenizer(tokenizer, num_threads, match_special_tokens)
    raise TypeError(
        f"unsupported tokenizer {type(tokenizer).__name__}: pass a tiktoken Encoding, a tokenizers.Tokenizer "
        "or a transformers PreTrainedTokenizerFast (or your own wds.llm.TokenizerAdapter)"
    )
