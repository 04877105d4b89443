"""Numbers that environment variables set (retry policy, concurrency), read one way: a bad value is an
error naming the variable, never a silent guess."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ["number_from_env"]

N = TypeVar("N", int, float)


def number_from_env(name: str, default: N, parse: Callable[[str], N], minimum: N) -> N:
    """The number the environment variable ``name`` sets, ``default`` where it is unset or empty. ``parse``
    reads it (``int``: a whole number, also written "3.0" or "1e1"; "2.5" is refused, not cut to 2);
    ``ValueError`` naming the variable where it is no finite number or is below ``minimum``."""
    text = os.environ.get(name)
    if not text:
        return default
    kind = "a whole number" if parse is int else "a number"
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not {kind}") from None
    if not math.isfinite(number) or (parse is int and not number.is_integer()):
        raise ValueError(f"{name}={text!r} is not {kind}")
    # (a whole number written "3.0" or "1e1": int() of that text would fail)
    value = parse(str(int(number)) if parse is int else text)
    if value < minimum:
        raise ValueError(f"{name}={text!r} is below {minimum}")
    return value
