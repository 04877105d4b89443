"""Events of the conversion jobs: fault injection for the tests."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


class _TestHook:
    """Fault injection for the tests: ``WDSRAFT_CONVERT_PAUSE_AT=EVENT:N`` makes the process touch
    ``WDSRAFT_CONVERT_PAUSE_MARKER`` and sleep when EVENT (``spill-unitU``, ``unit``, ``shard``,
    ``bucket``) happens for the Nth time, so that a test can SIGKILL it at a known point. Inert
    without the variable."""

    counts: dict[str, int] = {}

    @classmethod
    def reached(cls, event: str) -> None:
        spec = os.environ.get("WDSRAFT_CONVERT_PAUSE_AT")
        if not spec:
            return
        name, _, number = spec.partition(":")
        if name != event:
            return
        cls.counts[event] = cls.counts.get(event, 0) + 1
        if cls.counts[event] == int(number or 1):
            marker = os.environ.get("WDSRAFT_CONVERT_PAUSE_MARKER")
            if marker:
                with open(marker, "w") as handle:
                    handle.write(str(os.getpid()))
            while True:
                time.sleep(60)


_progress: Callable[[int], None] = lambda n: None  # noqa: E731 - replaced per process
