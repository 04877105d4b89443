"""webdataset's grouping rules, defined once: a member's key and extension, and which members are metadata."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

logger = logging.getLogger(__name__)


Handler = Callable[[BaseException], bool]


DEFAULT_SKIP_META = r"__[^/]*__($|/)"


# The same pattern as webdataset's base_plus_ext, compiled once for the hot loop.
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def split_key(name: str) -> tuple[str | None, str]:
    """webdataset's ``base_plus_ext`` (key up to the basename's first dot, then the extension), without
    the regex in the common case."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return None, ""
    if dot > slash + 1:
        return name[:dot], name[dot + 1 :]
    match = _KEY_EXT.match(name)  # a basename starting with a dot: the regex has its own answer
    return (match.group(1), match.group(2)) if match else (None, "")


_DEFAULT_META = re.compile(DEFAULT_SKIP_META)


def is_meta_member(name: str) -> bool:
    """Whether webdataset's reader skips this member by default (``__meta__`` files)."""
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return True
    return _DEFAULT_META.match(name) is not None
