"""``.decode()`` without webdataset's per-field handler walk: the same results, planned once per field name.

webdataset's ``Decoder`` asks every handler in turn about every field of every sample; the usual
handlers (``gzfilter``, ``basichandlers``, ``ImageHandler``, ``handle_extension``) answer from the
field's name alone whether they apply. :class:`DecodeStage` works that out once per field name
and per pass: the handlers that cannot apply are skipped, ``basichandlers`` is replaced by the
decoder it would call, and from the first handler it cannot rule out it walks the list exactly
as ``Decoder.decode1`` does (a ``None`` goes on to the next handler, a ``Continue`` renames).
Any other handler is asked as webdataset asks it. Errors are webdataset's ``DecodingError``.

The stage *is* webdataset's ``map(decoder, handler=...)`` for fingerprints and for code that
inspects curried stages: ``.f``, ``.args`` and ``.kw`` are those of webdataset's curried
``map``, so a state saved with webdataset's stage in the pipeline loads with this one, and back.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from functools import partial
from operator import methodcaller
from typing import Any

from webdataset import autodecode
from webdataset import filters as webdataset_filters
from webdataset.handlers import reraise_exception

Handler = Callable[[BaseException], bool]

#: How ``basichandlers`` and ``ImageHandler`` find a key's extension (their own expression).
_EXTENSION = re.compile(r".*[.]")

#: A field's plan: the index of the first handler that may answer, and, when that handler is
#: ``basichandlers`` (or ``handle_extension``'s wrapper) known to apply, the function it would call.
Plan = tuple[int, Callable[[bytes], Any] | None]
#: A shape's short way (``_compile_short_way``): the decoded sample, or None where the general way must decode it.
ShortWay = Callable[[dict[str, Any]], dict[str, Any] | None]


def _pil_importable() -> bool:
    try:
        import PIL.Image  # noqa: F401  (ImageHandler imports it before it looks at the key: so must we)
    except ImportError:
        return False
    return True


_JSON = json.JSONDecoder()  # (what json.loads uses when given no options)
_SCAN = _JSON.scan_once  # type: ignore[attr-defined]  # (what JSONDecoder.decode calls after skipping whitespace)


def _json_loads(data: bytes) -> Any:
    """``json.loads(data)``: bytes that json would read as UTF-8 (no BOM, no NUL in the first two) skip its
    encoding detection; anything else goes through json.loads itself."""
    if type(data) is bytes and data and data[0] not in _NOT_PLAIN_UTF8 and (len(data) < 2 or data[1]):
        text = data.decode("utf-8", "surrogatepass")
        try:  # the scanner alone, when it reads the whole text (no whitespace around the value)
            value, end = _SCAN(text, 0)
        except StopIteration:  # (leading whitespace, or no value: decode skips the one, reports the other)
            return _JSON.decode(text)
        return value if end == len(text) else _JSON.decode(text)
    return json.loads(data)


_NOT_PLAIN_UTF8 = frozenset((0x00, 0xEF, 0xFE, 0xFF))  # first bytes of NUL-led UTF-16/32 and of the BOMs

_UTF8 = methodcaller("decode", "utf-8")  # (as webdataset's: a bytes subclass's own decode() is called)

#: webdataset's decoder functions -> functions with the same results, without a Python frame or a detour.
_SAME_RESULT: dict[Any, Callable[[bytes], Any]] = {
    **{autodecode.decoders[name]: _UTF8 for name in ("txt", "text", "transcript")},  # data.decode("utf-8")
    **{autodecode.decoders[name]: _json_loads for name in ("json", "jsn")},  # json.loads(data)
    **{autodecode.decoders[name]: int for name in ("cls", "cls2", "index", "inx", "id")},  # int(data)
}


class _Planner:
    """Per field name, which handlers of a decoder can answer (decided from the name alone)."""

    def __init__(self, handlers: list[Any]):
        self.handlers = handlers
        self.decoders = autodecode.decoders  # (read when a plan is made: once per field name and pass)
        self._pil: bool | None = None

    def plan(self, field: str) -> Plan:
        key = "." + field  # (what decode1 hands its handlers)
        for position, handler in enumerate(self.handlers):
            verdict = self._verdict(handler, key)
            if verdict is None:
                continue  # this handler returns None for this key, whatever the data
            return position, (verdict if callable(verdict) else None)
        return len(self.handlers), None

    def _verdict(self, handler: Any, key: str) -> Any:
        """None: ``handler`` skips ``key``; a function: it would return that function's result on the data;
        True: ask the handler itself."""
        if handler is autodecode.gzfilter:
            return True if key.endswith(".gz") else None
        if handler is autodecode.basichandlers:
            function = self.decoders.get(_EXTENSION.sub("", key))
            return _SAME_RESULT.get(function, function) if function is not None else None
        if type(handler) is autodecode.ImageHandler:
            if self._pil is None:
                self._pil = _pil_importable()
            if not self._pil:
                return True  # it raises ImportError on every key: let it
            return True if _EXTENSION.sub("", key).lower() in handler.extensions else None
        if (
            type(handler) is partial
            and handler.func is autodecode.call_extension_handler
            and not handler.args
            and set(handler.keywords) == {"f", "extensions"}
        ):
            function = handler.keywords["f"]
            return function if _extension_matches(key, handler.keywords["extensions"]) else None
        return True  # any other handler: only asking it tells


def _extension_matches(key: str, extensions: list[str]) -> bool:
    """``call_extension_handler``'s test, without the call."""
    extension = key.lower().split(".")
    for target in extensions:
        parts = target.split(".")
        if len(parts) > len(extension):
            continue
        if extension[-len(parts) :] == parts:
            return True
    return False


def _walk(handlers: list[Any], position: int, key: str, data: Any) -> Any:
    """``Decoder.decode1`` from handler ``position`` on (``key`` with its leading dot)."""
    for handler in handlers[position:]:
        result = handler(key, data)
        if isinstance(result, autodecode.Continue):
            key, data = result.key, result.data
            continue
        if result is not None:
            return result
    return data


class DecodeStage(webdataset_filters.FilterFunction):
    """webdataset's ``map(decoder, handler=handler)`` for an ``autodecode.Decoder``, planned per field name.

    Called on an iterator of samples, it yields what webdataset's stage yields, sample for sample.
    """

    def __init__(self, decoder: autodecode.Decoder, handler: Handler = reraise_exception):
        # webdataset's curried map, as built by map(decoder, handler=handler): the stage this one stands for.
        super().__init__(webdataset_filters._map, decoder, handler=handler)

    def __call__(self, src: Iterator[Any]) -> Iterator[Any]:
        decoder, handler = self.args[0], self.kw["handler"]
        if type(decoder) is not autodecode.Decoder:  # a subclass may decode otherwise: webdataset's own stage
            return webdataset_filters._map(src, decoder, handler=handler)
        return self._run(src, decoder, handler)

    @staticmethod
    def _run(src: Iterator[Any], decoder: autodecode.Decoder, handler: Handler) -> Iterator[Any]:
        decoding = _SampleDecoder(decoder)
        shapes, short_way_for = decoding.shapes, decoding.short_way
        for sample in src:
            if type(sample) is dict:
                # The short way: a sample of a shape seen before whose fields all have a direct function goes
                # through that shape's own function (None back: this sample's values need the general way).
                shape = tuple(sample)
                short_way: Any = shapes.get(shape, False)  # (False: not planned yet; None: no short way)
                if short_way is False:
                    short_way = short_way_for(shape)
                if short_way is not None:
                    try:
                        result = short_way(sample)
                    except autodecode.DecodingError as error:
                        if handler(error):
                            continue
                        break
                    if result is not None:
                        yield result
                        continue
                try:
                    result = decoding._decode(sample)
                except Exception as exn:
                    if handler(exn):
                        continue
                    break
            else:
                try:
                    result = decoder(sample)
                except Exception as exn:
                    if handler(exn):
                        continue
                    break
            if result is None:
                continue
            if isinstance(sample, dict) and isinstance(result, dict):
                result["__key__"] = sample.get("__key__")
            yield result


#: A field's plan (``_SampleDecoder``): kept as it is ("__" fields: decoded if bytes, ``only`` leaves it).
_META, _KEPT = -1, -2
_MAX_SHAPES = 64  # samples of more shapes than this (field names vary from sample to sample): no shape plans
_MAX_SHORT_WAY_FIELDS = 256  # wider samples take the general way (compiling a function grows faster than its lines)


class _SampleDecoder:
    """``Decoder.decode`` for one pass, with the plans of the field names and of the sample shapes seen so far
    (``short_way``: one function per shape, for ``DecodeStage._run``; ``_decode`` is the general way)."""

    def __init__(self, decoder: autodecode.Decoder):
        self.handlers = list(decoder.handlers)
        self.only = decoder.only
        self.partial = decoder.partial
        self.plans: dict[Any, Plan] = {}
        self.shapes: dict[tuple[Any, ...], ShortWay | None] = {}
        self.planner = _Planner(self.handlers)

    def _plan(self, k: Any) -> Plan:
        if k[:2] == "__":
            return _META, None
        if self.only is not None and k not in self.only:
            return _KEPT, None
        return self.planner.plan(k)

    def short_way(self, shape: tuple[Any, ...]) -> ShortWay | None:
        """The short way for a shape whose every field is planned to a direct function or to no handler at all
        (:func:`_compile_short_way`); None for any other shape (or once many shapes were seen, or a very wide one)."""
        short_way: ShortWay | None = None
        if len(self.shapes) < _MAX_SHAPES and len(shape) <= _MAX_SHORT_WAY_FIELDS:
            meta, fields = [], []
            for k in shape:
                if k not in self.plans:
                    self.plans[k] = self._plan(k)
                position, function = self.plans[k]
                if position == _META:
                    meta.append(k)
                elif position == _KEPT:
                    continue
                elif function is not None or position == len(self.handlers):
                    fields.append((k, function, position))
                else:
                    break  # a handler to ask: the general way
            else:
                short_way = _compile_short_way(meta, fields, self.handlers, keyed="__key__" in shape)
            self.shapes[shape] = short_way
        return short_way

    def _decode(self, sample: dict[str, Any]) -> dict[str, Any]:
        plans, partial_ = self.plans, self.partial
        result: dict[str, Any] = {}
        k = None
        try:
            for k, v in sample.items():
                plan = plans.get(k)
                if plan is None:
                    plan = plans[k] = self._plan(k)
                position, function = plan
                if position < 0:
                    if position == _META and isinstance(v, bytes):
                        try:
                            v = v.decode("utf-8")
                        except Exception:
                            print(f"Can't decode v of k = {k} as utf-8: v = {v}")  # (webdataset's own message)
                    result[k] = v
                    continue
                assert v is not None
                if partial_:
                    if not isinstance(v, bytes):
                        result[k] = v
                        continue
                else:
                    assert isinstance(v, bytes), f"k,v = {k}, {v}"
                if function is not None:
                    value = function(v)
                    if value is None or isinstance(value, autodecode.Continue):  # rare: the walk takes over
                        value = _after(self.handlers, position, "." + k, v, value)
                    result[k] = value
                else:
                    result[k] = _walk(self.handlers, position, "." + k, v)
        except Exception as exn:
            raise _decoding_error(sample, k) from exn
        return result


def _compile_short_way(
    meta: list[Any], fields: list[tuple[Any, Callable[[bytes], Any] | None, int]], handlers: list[Any], keyed: bool
) -> ShortWay:
    """One shape's short way, as a function of its own: ``Decoder.decode``'s result for a sample of that shape
    (its "__" fields ``meta``; ``fields``: (name, direct function or None, handler position) for the others that
    are decoded or must be bytes), or None when this sample's values need the general way: bytes in a "__"
    field, or a field that is not bytes (webdataset's assert, ``partial``'s skip). A failing function raises
    webdataset's ``DecodingError`` for its field, as the general way does.

    The function is written out for the shape, a line per field: walking a plan field by field cost a third
    of the stage's own time. Field names, functions and handlers reach it as arguments of its factory (closure
    cells), never as source text: the source holds only generated names and handler positions."""
    cells: dict[str, Any] = {
        "handlers": handlers,
        "after": _after,
        "failed": _decoding_error,
        "Continue": autodecode.Continue,
    }
    body = []
    if meta:
        cells.update((f"m{i}", k) for i, k in enumerate(meta))
        body += [f"if {' or '.join(f'isinstance(sample[m{i}], bytes)' for i in range(len(meta)))}:", "    return None"]
    if fields:
        cells.update((f"f{i}", k) for i, (k, _, _) in enumerate(fields))
        body += [f"v{i} = sample[f{i}]" for i in range(len(fields))]
        body += [f"if {' or '.join(f'type(v{i}) is not bytes' for i in range(len(fields)))}:", "    return None"]
    body.append("result = sample.copy()")
    for i, (_, function, position) in enumerate(fields):
        if function is None:
            continue  # (no handler at all for it: left as it is)
        # (a short way's field is exactly bytes, whose own decode() this is: one call less than the methodcaller)
        cells[f"d{i}"] = bytes.decode if function is _UTF8 else function
        body += ["try:", f"    value = d{i}(v{i})"]
        # (None or a Continue: the handler walk goes on from the next handler; json.loads gives no Continue)
        if function is _json_loads:
            body.append("    if value is None:")
        elif not _plain_answer(function):
            body.append("    if value is None or isinstance(value, Continue):")
        if not _plain_answer(function):
            body.append(f"        value = after(handlers, {int(position)}, '.' + f{i}, v{i}, value)")
        body += ["except Exception as exn:", f"    raise failed(sample, f{i}) from exn", f"result[f{i}] = value"]
    if not keyed:
        body.append("result['__key__'] = None  # (webdataset's map sets the sample's, absent here)")
    body.append("return result")
    source = "\n".join(
        [f"def factory({', '.join(cells)}):", "    def short_way(sample):"]
        + [f"        {line}" for line in body]
        + ["    return short_way"]
    )
    short_way: ShortWay = _factory(source)(**cells)
    return short_way


@functools.lru_cache(maxsize=256)
def _factory(source: str) -> Callable[..., ShortWay]:
    """The factory ``source`` defines, compiled once per process (a pass compiling its shapes anew cost 0.2 ms
    a shape: every epoch, in every worker)."""
    namespace: dict[str, Any] = {}
    exec(compile(source, "<wdsraft.pipeline.decode short way>", "exec"), namespace)
    factory: Callable[..., ShortWay] = namespace["factory"]
    return factory


def _plain_answer(function: Callable[[bytes], Any]) -> bool:
    """Whether ``function`` never answers None nor a ``Continue`` (no handler walk can follow it)."""
    return function is _UTF8 or function is int


def _decoding_error(sample: dict[str, Any], k: Any) -> autodecode.DecodingError:
    """The error webdataset's decoder raises for field ``k`` (its cause: the handler's own error)."""
    return autodecode.DecodingError(key=sample.get("__key__"), url=sample.get("__url__"), k=k, sample=sample)


def _after(handlers: list[Any], position: int, key: str, data: Any, answer: Any) -> Any:
    """What ``decode1`` does after handler ``position`` answered ``answer`` (None or a ``Continue``)."""
    if isinstance(answer, autodecode.Continue):
        return _walk(handlers, position + 1, answer.key, answer.data)
    return _walk(handlers, position + 1, key, data)
