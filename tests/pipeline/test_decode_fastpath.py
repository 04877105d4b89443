"""``.decode()``'s planned stage (``wdsraft.pipeline.decode.DecodeStage``) against webdataset's own
``map(Decoder(...))``, side by side on the same samples: the same values, types, keys, errors and skips."""

from __future__ import annotations

import codecs
import gzip
import io
import json
import pickle
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import webdataset
import webdataset.autodecode as autodecode
import webdataset.filters

import wdsraft as wds
from wdsraft.core.state import describe
from wdsraft.pipeline import decode as decode_module
from wdsraft.pipeline.decode import DecodeStage

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings


def _npy(array: np.ndarray) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array)
    return stream.getvalue()


def _npz(**arrays: np.ndarray) -> bytes:
    stream = io.BytesIO()
    np.savez(stream, **arrays)
    return stream.getvalue()


def _samples() -> list[dict[str, Any]]:
    """Samples over the common extensions, and the corners of the handler walk."""
    base = {"__url__": "shard-0.tar", "__ordinal__": 3, "__offset__": 1536, "__local_path__": "/d/shard-0.tar"}
    return [
        {"__key__": "a", **base, "txt": "héllo".encode(), "json": b'{"id": 1, "t": "\\u00e9"}', "cls": b"7"},
        {"__key__": "b", **base, "text": b"x", "transcript": b"y", "jsn": b"[1, 2]", "cls2": b" 12 ", "id": b"3"},
        {"__key__": "c", **base, "index": b"4", "inx": b"5", "npy": _npy(np.arange(6).reshape(2, 3))},
        {"__key__": "d", **base, "npz": _npz(a=np.ones(3)), "pkl": pickle.dumps({"p": 1}), "mp": msgpack.packb([1])},
        {"__key__": "e", **base, "msg": msgpack.packb({"m": 2}), "pickle": pickle.dumps(3), "pyd": pickle.dumps(4)},
        # json.loads returns None for "null": webdataset then walks on and hands out the bytes
        {"__key__": "f", **base, "json": b"null", "jsn": b"  null"},
        # json's encoding detection: BOMs, UTF-16/32 without BOM, short documents
        {"__key__": "g", **base, "json": codecs.BOM_UTF8 + b'{"a": 1}', "jsn": '{"b": 2}'.encode("utf-16")},
        {"__key__": "h", **base, "json": '{"c": 3}'.encode("utf-16-le"), "jsn": '"x"'.encode("utf-32-be")},
        {"__key__": "i", **base, "json": b"1", "jsn": b"12"},
        {"__key__": "i2", **base, "json": b'{"a": [1, 2.5, null]}\n ', "jsn": b'"s"', "id": b"\t7\n"},
        # compressed fields: gzfilter's Continue renames and decodes further
        {"__key__": "j", **base, "txt.gz": gzip.compress(b"zipped"), "json.gz": gzip.compress(b'{"z": 1}')},
        # dotted and upper-case names, unknown extensions, bytes in "__" fields
        {"__key__": b"k", **base, "seg.txt": b"dotted", "TXT": b"upper", "bin": b"\x00\x01", "a.b.json": b"{}"},
        {
            "__key__": "l",
            **base,
            "__extra__": b"\xff\xfe",
            "__note__": b"n\xc3\xa9",
            "gzip": b"not gzip: kept",
            "x.gz.txt": b"t",
        },
    ]


def _both(build: Any, samples: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    """The samples through webdataset's ``.decode(...)`` and through wdsraft's, each on its own copy."""
    theirs = webdataset.DataPipeline(lambda: iter([dict(s) for s in samples]), build(webdataset.filters))
    ours_stage = build(wds.filters)
    assert type(ours_stage).__name__ == "FilterFunction"  # (built with webdataset's map, as webdataset does)
    decoder, handler = ours_stage.args[0], ours_stage.kw["handler"]
    ours = DecodeStage(decoder, handler=handler)
    return list(theirs), list(ours(iter([dict(s) for s in samples])))


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert a == b


def _decode(*handlers: Any, handler: Any = webdataset.handlers.reraise_exception, **kw: Any) -> Any:
    """What webdataset's ``.decode(*handlers, **kw, handler=...)`` appends, built from ``filters``' ``map``."""
    return lambda filters: filters.map(autodecode.Decoder(list(handlers), **kw), handler=handler)


def test_default_handlers_give_webdatasets_results_on_the_common_extensions() -> None:
    theirs, ours = _both(_decode(), _samples())
    assert len(ours) == len(_samples())
    _same(theirs, ours)
    assert ours[0]["json"] == {"id": 1, "t": "é"} and ours[5]["json"] == b"null"  # (the corner really ran)
    assert ours[6]["json"] == {"a": 1} and ours[10]["txt.gz"] == "zipped" and ours[11]["__key__"] == b"k"
    assert ours[12]["__note__"] == "né" and ours[12]["__extra__"] == b"\xff\xfe" and ours[4]["msg"] == {"m": 2}


@pytest.mark.parametrize(
    "options",
    [
        {"only": ["txt", "json"]},
        {"only": "txt"},
        {"partial": True},
        {"pre": []},
        {"post": []},
        {"pre": [], "post": [autodecode.basichandlers, autodecode.gzfilter]},
    ],
    ids=["only-list", "only-str", "partial", "no-pre", "no-post", "reordered"],
)
def test_decoder_options_as_webdatasets(options: dict[str, Any]) -> None:
    samples = _samples()
    if options.get("partial"):
        samples = [{**s, "done": 42, "txt": "decoded before"} for s in samples]  # (fields no longer bytes)
    theirs, ours = _both(_decode(**options), samples)
    _same(theirs, ours)
    if options.get("partial"):
        assert ours[0]["txt"] == "decoded before" and ours[0]["json"] == {"id": 1, "t": "é"}


def test_a_field_that_is_not_bytes_fails_as_in_webdataset() -> None:
    sample = {"__key__": "a", "json": b"{}", "txt": "decoded before"}
    errors = []
    for side in (0, 1):
        with pytest.raises(autodecode.DecodingError) as error:
            _both_lazily(_decode(), [sample], side)
        errors.append((error.value.k, type(error.value.__cause__)))
    assert errors[0] == errors[1] == ("txt", AssertionError)


def test_handle_extension_and_own_handlers_as_webdatasets() -> None:
    calls: list[str] = []

    def own(key: str, data: bytes) -> Any:
        calls.append(key)
        return None if key.endswith(".txt") else (key, len(data))

    theirs, ours = _both(
        _decode(
            autodecode.handle_extension("seg.txt", lambda data: b"seg:" + data),
            autodecode.handle_extension("JSON jsn", lambda data: None),  # None: on to the next handler
            autodecode.handle_extension("bin", lambda data: autodecode.Continue("bin.txt", data)),  # renamed
            own,
        ),
        _samples(),
    )
    _same(theirs, ours)
    assert calls[: len(calls) // 2] == calls[len(calls) // 2 :]  # asked about the same keys, in the same order
    assert ours[11]["bin"] == "\x00\x01" and ours[11]["seg.txt"] == b"seg:dotted"


def test_image_handler_without_or_with_pil_as_webdatasets() -> None:
    try:
        import PIL.Image
    except ImportError:  # webdataset's ImageHandler imports PIL for every field: both fail on the first
        samples = [{"__key__": "a", "txt": b"t", "cls": b"1"}]
        errors = []
        for run in (lambda: _both(_decode(autodecode.ImageHandler("rgb8")), samples)[0], lambda: _ours_only()):
            with pytest.raises(autodecode.DecodingError) as error:
                run()
            errors.append((error.value.key, error.value.k, type(error.value.__cause__)))
        assert errors[0] == errors[1] and errors[0][:2] == ("a", "txt") and issubclass(errors[0][2], ImportError)
        return
    stream = io.BytesIO()
    PIL.Image.new("RGB", (4, 3), (10, 20, 30)).save(stream, format="PNG")
    samples = [{"__key__": "a", "png": stream.getvalue(), "PNG": stream.getvalue(), "txt": b"t", "cls": b"1"}]
    for spec in ("rgb8", "l", "torchrgb8", "pil"):
        theirs, ours = _both(_decode(autodecode.ImageHandler(spec)), samples)
        assert not isinstance(ours[0]["png"], bytes) and ours[0]["txt"] == "t"
        for a, b in zip(theirs, ours, strict=True):
            assert list(a) == list(b)
            for key in a:
                if isinstance(a[key], PIL.Image.Image):
                    assert (a[key].mode, a[key].size, a[key].tobytes()) == (b[key].mode, b[key].size, b[key].tobytes())
                else:
                    _same(a[key], b[key])


def _ours_only() -> list[Any]:
    stage = DecodeStage(autodecode.Decoder([autodecode.ImageHandler("rgb8")]))
    return list(stage(iter([{"__key__": "a", "txt": b"t", "cls": b"1"}])))


def test_errors_name_the_same_field_and_the_handler_skips_as_webdatasets() -> None:
    bad = [
        {"__key__": "a", "txt": b"fine"},
        {"__key__": "b", "txt": b"fine", "json": b"{broken", "cls": b"x"},
        {"__key__": "c", "txt": b"\xff", "json": b"{}"},
        {"__key__": "d", "cls": b"8"},
    ]
    errors = []
    for side in (0, 1):
        with pytest.raises(autodecode.DecodingError) as error:
            _both_lazily(_decode(), bad, side)
        errors.append((error.value.key, error.value.k, type(error.value.__cause__), error.value.sample))
    assert errors[0] == errors[1] and errors[0][:3] == ("b", "json", json.JSONDecodeError)
    skipped = _both(_decode(handler=webdataset.handlers.ignore_and_continue), bad)
    _same(*skipped)
    assert [s["__key__"] for s in skipped[1]] == ["a", "d"]
    stopped = _both(_decode(handler=webdataset.handlers.ignore_and_stop), bad)
    _same(*stopped)
    assert [s["__key__"] for s in stopped[1]] == ["a"]


@pytest.mark.parametrize("text", [b"{} {}", b"]", b"{broken", b"  ", b'{"a": 1,}', b"\xff{}", b"nul"])
def test_bad_json_fails_with_jsons_own_error(text: bytes) -> None:
    errors = []
    for side in (0, 1):
        with pytest.raises(autodecode.DecodingError) as error:
            _both_lazily(_decode(), [{"__key__": "a", "json": text}], side)
        errors.append((error.value.k, type(error.value.__cause__), str(error.value.__cause__)))
    assert errors[0] == errors[1]


def test_the_short_way_is_judged_sample_by_sample_as_webdatasets() -> None:
    """A shape seen before takes the short way only when this sample's values allow it; samples without a
    ``__key__`` (the result gets one, None), of one field or none, go as in webdataset."""
    samples = [
        {"__key__": "a", "txt": b"x", "cls": b"1"},
        {"__key__": "b", "txt": "already text", "cls": b"2"},  # the same shape, a field that is not bytes
        {"__key__": "c", "txt": b"y", "cls": b"3", "__url__": b"u"},  # bytes in a "__" field
        {"__key__": "c2", "txt": b"y", "cls": b"3", "__url__": "u"},  # (that shape again, no bytes there)
        {"__key__": "d", "txt": b"z", "cls": b"4"},
        {"txt": b"no key"},
        {"txt": b"no key again"},
        {"__url__": "u"},
        {"bin": b"\x00"},
        {},
        {"__key__": "e", "json": b"null"},
    ]
    for options in ({"partial": True}, {"handler": webdataset.handlers.ignore_and_continue}):
        theirs, ours = _both(_decode(**options), samples)
        _same(theirs, ours)
        assert [s["__key__"] for s in ours][-6:] == [None, None, None, None, None, "e"]
    assert ours[1]["__url__"] == "u" and ours[0]["txt"] == "x" and len(ours) == len(samples) - 1


def test_field_names_reach_the_short_way_as_values_never_as_code() -> None:
    """Each shape's short way is a function written for it: names that would be code in its source (quotes, a
    tab, a call) are values there, decoded and kept as in webdataset, and run nothing."""
    odd = ["a'] or exit(1) or x['.txt", 'b"\t) or (.json', "c\\'.cls", "__'+exit(2)+'__", "d{m0}.txt"]
    samples = [
        {"__key__": f"k{n}", odd[3]: "meta", odd[0]: b"t", odd[1]: b"[1]", odd[2]: b"7", odd[4]: b"x"} for n in range(3)
    ]
    theirs, ours = _both(_decode(), samples)
    _same(theirs, ours)
    assert ours[2] == {"__key__": "k2", odd[3]: "meta", odd[0]: "t", odd[1]: [1], odd[2]: 7, odd[4]: "x"}


def test_a_shapes_short_way_is_compiled_once_per_process() -> None:
    """Each pass plans its shapes anew; the code of a shape's short way is compiled once, then reused."""
    samples = [{"__key__": f"k{n}", "__url__": "u", f"f{n % 2}.txt": b"t", "json": b"{}"} for n in range(4)]
    stage = DecodeStage(autodecode.Decoder([autodecode.basichandlers]))
    list(stage(iter(samples)))  # (the two shapes: compiled here, if no test before compiled them)
    compiled = decode_module._factory.cache_info().misses
    for _ in range(3):
        assert [s["json"] for s in stage(iter(samples))] == [{}] * 4
    assert decode_module._factory.cache_info().misses == compiled


class _OwnDecode(bytes):
    """A bytes subclass with its own ``decode``: webdataset's ``data.decode("utf-8")`` calls it."""

    def decode(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return "its own"


def test_a_bytes_subclass_and_a_very_wide_sample_decode_as_in_webdataset() -> None:
    """Values that are not exactly bytes, and samples too wide for a short way of their own, take the general
    way: webdataset's results (a subclass's own ``decode``), and nothing compiled for the wide shape."""
    samples = [{"__key__": "a", "t.txt": _OwnDecode(b"x")}, {"__key__": "b", "t.txt": _OwnDecode(b"y")}]
    for options in ({}, {"partial": True}):
        theirs, ours = _both(_decode(**options), samples)
        _same(theirs, ours)
        assert ours[1]["t.txt"] == "its own"
    wide = [{"__key__": f"k{n}", **{f"f{i}.txt": b"v" for i in range(300)}} for n in range(2)]
    compiled = decode_module._factory.cache_info().misses
    theirs, ours = _both(_decode(), wide)
    _same(theirs, ours)
    assert ours[1]["f299.txt"] == "v" and decode_module._factory.cache_info().misses == compiled


def _both_lazily(build: Any, samples: list[dict[str, Any]], side: int) -> list[Any]:
    """One side of ``_both`` (webdataset's: 0, wdsraft's: 1), so that each side's error is caught on its own."""
    stage = build(webdataset.filters)
    if side == 1:
        stage = DecodeStage(stage.args[0], handler=stage.kw["handler"])
    return list(stage(iter([dict(s) for s in samples])))


def test_fluent_decode_is_the_planned_stage_and_keeps_webdatasets_fingerprint(urls_txt_json: list[str]) -> None:
    ours = wds.WebDataset(urls_txt_json, shardshuffle=False).decode()
    stage = ours.pipeline[-1]
    assert isinstance(stage, DecodeStage) and isinstance(stage, webdataset.filters.FilterFunction)
    # What webdataset's .decode() appends, in the pipeline instead: the same fingerprint, states load across.
    plain = webdataset.filters.map(autodecode.Decoder([]), handler=webdataset.handlers.reraise_exception)
    assert describe(stage) == describe(plain)
    before = wds.WebDataset(urls_txt_json, shardshuffle=False).compose(plain)
    assert before.fingerprint() == ours.fingerprint()
    stream = iter(before)
    for _ in range(7):
        next(stream)
    ours.load_state_dict(before.state_dict())
    assert [s["__key__"] for s in ours] == [f"{n:05d}" for n in range(7, 12)]
    theirs = webdataset.WebDataset(urls_txt_json, shardshuffle=False).decode()
    decoded = list(ours)
    expected = list(theirs)
    assert len(decoded) == len(expected) > 0
    for a, b in zip(expected, decoded, strict=True):
        for key in ("__key__", "txt", "json"):
            _same(a[key], b[key])


@pytest.fixture(scope="module")
def urls_txt_json(write_shards, corpus_records) -> list[str]:
    records = corpus_records[:12]
    return write_shards("dec", [{"txt": r["text"][:50], "json": {"id": r["id"]}} for r in records], 5)
