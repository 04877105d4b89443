"""What a ``WebLoader`` worker hands to the training process: batches collated exactly as webdataset's
``default_collation_fn`` collates them and converted exactly as DataLoader's ``default_convert`` converts
them, however either is done."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_convert
from webdataset.filters import default_collation_fn

from wdsraft.pipeline.batch import batched
from wdsraft.pipeline.loader import convert_batch

_leaves = st.one_of(
    st.text(max_size=3),
    st.binary(max_size=3),
    st.integers(-5, 5),
    st.booleans(),
    st.floats(allow_nan=False),
    st.none(),
    st.integers(0, 9).map(np.int64),  # a numpy scalar: default_convert makes a tensor of it
    st.lists(st.integers(0, 9), max_size=3).map(np.array),
    st.lists(st.text(max_size=2), min_size=1, max_size=2).map(np.array),  # strings: left as they are
)
_values = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),  # default_convert makes a list of a tuple
        st.dictionaries(st.text(max_size=3), inner, max_size=4),
    ),
    max_leaves=12,
)


def _same(got: Any, expected: Any, original: Any) -> None:
    assert type(got) is type(expected), (got, expected)
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    elif isinstance(expected, np.ndarray):
        assert got.dtype == expected.dtype and np.array_equal(got, expected)
    elif isinstance(expected, dict):
        assert list(got) == list(expected)  # same keys, same order
        assert got is not original  # a copy, as default_convert's
        for key in expected:
            _same(got[key], expected[key], original[key])
    elif isinstance(expected, list):
        assert len(got) == len(expected) and got is not original
        for a, b, c in zip(got, expected, original, strict=True):
            _same(a, b, c)
    else:
        assert got == expected or (got != got and expected != expected)


@settings(max_examples=150, deadline=None)
@given(value=_values)
def test_conversion_is_default_convert(value) -> None:
    _same(convert_batch([value]), default_convert([value]), [value])  # (in a list: a dict is not a batch)
    batch = {"x": value, "__key__": [value]}  # metadata fields are left alone
    converted = convert_batch(batch)
    assert converted["__key__"] is batch["__key__"]
    _same(converted["x"], default_convert(value), value)


def test_decoded_text_and_json_batch_is_copied_not_walked() -> None:
    batch = {"txt": ["a", "b"], "json": [{"id": "1", "n": 2}, {"id": "2", "n": None}], "cls": np.arange(2)}
    converted = convert_batch(batch)
    assert converted["txt"] == ["a", "b"] and converted["txt"] is not batch["txt"]
    assert converted["json"] == batch["json"] and converted["json"][0] is not batch["json"][0]
    assert isinstance(converted["cls"], torch.Tensor)


_fields = st.dictionaries(
    st.sampled_from(["txt", "cls", "__key__", "json", "npy", "pt", "n"]),
    st.sampled_from(["str", "int", "float", "dict", "array", "tensor", "bytes"]),
    min_size=1,
)


def _value(kind: str, n: int) -> Any:
    return {
        "str": f"s{n}",
        "int": n,
        "float": n / 2,
        "dict": {"id": n},
        "array": np.arange(3) + n,
        "tensor": torch.arange(2) + n,
        "bytes": bytes([n % 256]),
    }[kind]


@settings(max_examples=100, deadline=None)
@given(fields=_fields, count=st.integers(1, 6), odd=st.sampled_from([None, "missing", "extra", "tuple"]))
def test_batched_collates_dicts_as_webdataset_does(fields, count, odd) -> None:
    samples: list[Any] = [{key: _value(kind, n) for key, kind in fields.items()} for n in range(count)]
    if odd == "missing" and count > 1:
        samples[-1].pop(next(iter(fields)))
    elif odd == "extra":
        samples[-1]["zzz"] = 1
    elif odd == "tuple" and count > 1:
        samples[-1] = tuple(samples[-1].values())
    try:
        expected = default_collation_fn(list(samples))
    except AssertionError as error:
        with pytest.raises(AssertionError, match=str(error)):
            list(batched(count)(iter(samples)))
        return
    (got,) = list(batched(count)(iter(samples)))
    assert list(got) == list(expected)  # the same keys in the same order (a set's order, as webdataset's)
    for key, value in expected.items():
        assert type(got[key]) is type(value)
        if isinstance(value, (np.ndarray, torch.Tensor)):
            assert got[key].dtype == value.dtype and (got[key] == value).all()
        else:
            assert got[key] == value


_WORKER_START_PROBE = """
import sys
import torch.utils.data
import wdsraft as wds

class Numbers(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))

assert "numpy.random" not in sys.modules, "imported before any worker started: nothing to check"
assert sorted(wds.WebLoader(Numbers(), batch_size=None, num_workers=1)) == [0, 1, 2]
print("numpy.random" in sys.modules)
"""


def test_workers_find_numpy_random_imported_when_they_start() -> None:
    # Each worker seeds numpy.random as it starts: imported in the training process once, not in every
    # forked worker every epoch.
    result = subprocess.run([sys.executable, "-c", _WORKER_START_PROBE], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True"]
