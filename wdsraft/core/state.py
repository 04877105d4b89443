"""Plain-data state: fingerprints of configurations, RNG states as bytes, mismatch errors.

States are nested dicts of ints, strings, bytes, lists and bools: they survive
``torch.save``/``torch.load(weights_only=True)``, msgpack and (bytes aside) JSON, and
loading them never runs code.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import struct
from typing import Any

STATE_FORMAT = "wdsraft-pipeline-state"
STATE_VERSION = 1


def describe(value: Any) -> Any:
    """A stable, plain description of a configuration value for fingerprints."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [describe(item) for item in value]
    if isinstance(value, dict):
        return {str(key): describe(item) for key, item in sorted(value.items(), key=lambda kv: str(kv[0]))}
    name = getattr(value, "__qualname__", None) or getattr(type(value), "__qualname__", "?")
    module = getattr(value, "__module__", None) or type(value).__module__
    if hasattr(value, "f") and hasattr(value, "args") and hasattr(value, "kw"):  # webdataset's curried stages
        return {"f": describe(value.f), "args": describe(value.args), "kw": describe(value.kw)}
    if not callable(value) or not hasattr(value, "__qualname__"):  # a configured object: its plain settings
        settings = {
            key: describe(item)
            for key, item in sorted(vars(value).items() if hasattr(value, "__dict__") else [])
            if not key.startswith("_") and isinstance(item, (bool, int, float, str, type(None), list, tuple))
        }
        return {"type": f"{module}.{name}", **settings} if settings else f"{module}.{name}"
    return f"{module}.{name}"


def fingerprint(config: Any) -> str:
    return text_fingerprint(json.dumps(describe(config), sort_keys=True, separators=(",", ":")))


def text_fingerprint(text: str) -> str:
    """The fingerprint of a configuration already described as text (``config_text``): what ``fingerprint``
    returns for that configuration, without describing it again."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable list of configuration fields that differ."""
    found = []
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        saved, current = dict(enumerate(saved)), dict(enumerate(current))
    for key in sorted(set(saved) | set(current), key=str):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if (isinstance(a, dict) and isinstance(b, dict)) or (
            isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
        ):
            found += differences(a, b, f"{prefix}{key}.")  # type: ignore[arg-type]
        elif a != b:
            found.append(f"{prefix}{key}: saved {_short(a)}, now {_short(b)}")
    return found


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_MT_STATE = struct.Struct("<625I")


def pack_rng(rng: random.Random) -> str:
    """The Mersenne Twister state (624 words and a position) as 3.3 KB of base64: plain text that
    JSON, msgpack and ``torch.load(weights_only=True)`` all carry."""
    version, internal, gauss = rng.getstate()
    assert version == 3 and gauss is None, "unexpected random.Random state"
    return base64.b64encode(_MT_STATE.pack(*internal)).decode("ascii")


def unpack_rng(packed: str) -> random.Random:
    rng = random.Random()
    rng.setstate((3, _MT_STATE.unpack(base64.b64decode(packed)), None))
    return rng


def make_seed(*parts: Any) -> int:
    """A 63-bit seed from ints and strings, the same in every process (unlike ``hash()``)."""
    digest = hashlib.sha256(repr(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def config_text(config: dict[str, Any]) -> str:
    """The configuration a state was saved with, for the message when it does not match: one JSON
    string, so that taking a state (every few steps, in every worker) does not copy a tree."""
    return json.dumps(describe(config), sort_keys=True, separators=(",", ":"))
