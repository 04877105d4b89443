"""Numbers that environment variables set (retry policy, concurrency), read one way: a bad value is an
error naming the variable, never a silent guess."""

from __future__ import annotations

import math
import os
from typing import TypeVar

__all__ = ["number_from_env"]

N = TypeVar("N", int, float)


def number_from_env(name: str, default: N, minimum: N) -> N:
    """The number the environment variable ``name`` sets, ``default`` where it is unset or empty; of the
    default's type (an ``int``: a whole number, also written "3.0" or "1e1"; "2.5" is refused, not cut to 2).
    ``ValueError`` naming the variable where it is no finite number or is below ``minimum``."""
    text = os.environ.get(name)
    if not text:
        return default
    whole = isinstance(default, int)
    kind = "a whole number" if whole else "a number"
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not {kind}") from None
    if not math.isfinite(number) or (whole and not number.is_integer()):
        raise ValueError(f"{name}={text!r} is not {kind}")
    value = type(default)(number)
    if value < minimum:
        raise ValueError(f"{name}={text!r} is below {minimum}")
    return value
