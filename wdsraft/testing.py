"""The resume oracle, for wdsraft's tests and for your own stages.

``assert_resumes_everywhere(make)`` runs a pipeline once without interruption, taking its
state before every element, then restores each of those states into a *fresh* pipeline
(built by ``make()`` after the global RNGs were reseeded differently) and checks that it
yields exactly the rest of the uninterrupted stream, element by element. Each state first
makes a round trip through msgpack, JSON or ``torch.save``/``torch.load(weights_only=True)``
(states are plain data), and reading the state back right after loading it must give the
loaded state again.

Use it on any ``DataPipeline`` (``WebDataset``, ``WebLoader``, ``DataPipeline`` with your own
``Stage``)::

    from wdsraft.testing import assert_resumes_everywhere

    def make():
        return wds.WebDataset(urls, shardshuffle=5, seed=1).shuffle(20).decode().batched(4)

    assert_resumes_everywhere(make)
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import torch

__all__ = ["assert_resumes_everywhere", "identity", "resume", "roundtrip", "state_shape", "states_along"]

#: How a state is carried between runs in ``assert_resumes_everywhere``, by kill point in turn.
CARRIERS = ("msgpack", "json", "torch")


def identity(item: Any) -> Any:
    """A comparable identity for samples, tuples, tensors and batches.

    A sample (a dict with ``__key__``) is its key and a digest of its contents (every field but the
    ``__``-prefixed metadata), so a stream that hands out the right keys with altered payloads (a
    field cut short, another sample's bytes under this key) compares unequal."""
    if isinstance(item, dict):
        if "__key__" in item:
            return (item["__key__"], _content_digest(item))
        return tuple((key, identity(value)) for key, value in sorted(item.items()))
    if isinstance(item, (torch.Tensor, np.ndarray)):
        return identity(item.tolist())
    if isinstance(item, (list, tuple)):
        return tuple(identity(x) for x in item)
    return item


def _content_digest(sample: dict[str, Any]) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(sample):
        if not name.startswith("__"):
            digest.update(name.encode() + b"\0")
            _feed(digest, sample[name])
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    """Feed a field's value to ``digest``: bytes as they are, arrays by dtype, shape and bytes, containers
    element by element, anything else (decoded images included) by type and ``repr``/``tobytes``."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        digest.update(b"b%d:" % len(value) + bytes(value))
    elif isinstance(value, str):
        _feed(digest, value.encode())
    elif isinstance(value, torch.Tensor):
        _feed(digest, value.detach().cpu().numpy())
    elif isinstance(value, np.ndarray):
        digest.update(f"a{value.dtype}{value.shape}:".encode() + np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        digest.update(b"d%d:" % len(value))
        for key in sorted(value, key=repr):
            _feed(digest, repr(key))
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(b"l%d:" % len(value))
        for element in value:
            _feed(digest, element)
    elif callable(getattr(value, "tobytes", None)):  # (a PIL image, a numpy scalar)
        digest.update(f"{type(value).__name__}:".encode())
        _feed(digest, value.tobytes())
    else:
        digest.update(f"{type(value).__name__}:{value!r}".encode())


def roundtrip(state: dict[str, Any], how: str) -> dict[str, Any]:
    """``state`` after a trip through ``json``, ``msgpack`` or ``torch`` (``torch.load(weights_only=True)``)."""
    if how == "json":
        return json.loads(json.dumps(state))
    if how == "msgpack":
        return msgpack.unpackb(msgpack.packb(state), strict_map_key=False)
    if how != "torch":
        raise ValueError(f"unknown carrier {how!r}: one of {CARRIERS}")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def states_along(make: Callable[[], Any], limit: int | None = None) -> tuple[list[Any], list[dict[str, Any]]]:
    """The uninterrupted stream (as identities) and the state before each of its elements (and after the last)."""
    pipeline = make()
    iterator = iter(pipeline)
    stream, states = [], [pipeline.state_dict()]
    for item in iterator:
        stream.append(identity(item))
        states.append(pipeline.state_dict())
        if limit is not None and len(stream) >= limit:
            break
    return stream, states


def resume(make: Callable[[], Any], state: dict[str, Any], how: str = "msgpack", seed: int = 0) -> list[Any]:
    """The stream (as identities) of a fresh pipeline restored from ``state`` after a trip through ``how``.

    The global RNGs are reseeded first: a restored pipeline must not depend on them.
    """
    random.seed(10_000 + seed)
    np.random.seed(10_000 + seed)
    torch.manual_seed(10_000 + seed)
    pipeline = make()
    carried = roundtrip(state, how)
    pipeline.load_state_dict(carried)
    read_back = pipeline.state_dict()
    if read_back != carried:
        raise AssertionError("the state read right after load_state_dict differs from the state loaded")
    return [identity(item) for item in pipeline]


def state_shape(state: Any) -> Any:
    """A state's structure: dict keys kept, lists and byte strings reduced to their type (their
    lengths grow with what a stage holds), other leaves to their type name."""
    if isinstance(state, dict):
        return {key: state_shape(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return "list"
    return type(state).__name__


def assert_resumes_everywhere(
    make: Callable[[], Any], kill_points: list[int] | None = None, same_shape: bool = True
) -> list[Any]:
    """Restore before every element (or at ``kill_points``) and compare with the uninterrupted stream.

    With ``same_shape``, every state taken while the pipeline runs must have the structure of the
    one taken after its first element (``state_shape``): the same keys at every step, only the
    lengths of lists varying. (The state before the first element is the pipeline's initial state,
    in which stages that have not run yet hold no entry.) Returns the uninterrupted stream.
    """
    stream, states = states_along(make)
    if same_shape and len(states) > 2:
        first = state_shape(states[1])
        for step, state in enumerate(states[1:], start=1):
            if state_shape(state) != first:
                raise AssertionError(f"the state's structure changed at step {step}: {state_shape(state)} != {first}")
    points = range(len(states)) if kill_points is None else [min(k, len(states) - 1) for k in kill_points]
    for k in points:
        resumed = resume(make, states[k], CARRIERS[k % len(CARRIERS)], seed=k)
        if resumed != stream[k:]:
            raise AssertionError(f"resume before element {k}: {resumed[:5]}... != {stream[k : k + 5]}...")
    return stream
