"""Named events of the conversion jobs, and the listeners that act on them.

The jobs say what happened, not who cares:

- ``bytes read`` (stored input bytes, as the scatter reads them) and ``samples written`` (as
  the write phase writes them), with the amount;
- ``spill`` (a unit's buffers written to its data file) and ``unit done``, with the unit;
  ``shard written``, with the shard; ``bucket done``, with the bucket.

Progress listens always: it adds the amounts to whatever the job runner points it at (its
progress bar, or a counter shared with the worker processes). Pause listens only when
``WDSRAFT_CONVERT_PAUSE_AT`` is set: fault injection, so that a test can kill a conversion at a
known point.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

BYTES_READ = "bytes read"
SAMPLES_WRITTEN = "samples written"
SPILL = "spill"
UNIT_DONE = "unit done"
SHARD_WRITTEN = "shard written"
BUCKET_DONE = "bucket done"

Listener = Callable[[str, int, dict[str, Any]], None]

_listeners: list[Listener] = []


def emit(event: str, amount: int = 1, **details: Any) -> None:
    """Tell the listeners that ``event`` happened (``amount``: bytes or samples; ``details``: which one)."""
    for listener in _listeners:
        listener(event, amount, details)


def listen(listener: Listener) -> None:
    _listeners.append(listener)


class Progress:
    """Adds the amounts of ``bytes read`` and ``samples written`` to ``advance``: nothing until the job
    runner points it at a progress bar (jobs in this process) or at a counter its workers share."""

    COUNTED = frozenset({BYTES_READ, SAMPLES_WRITTEN})

    def __init__(self) -> None:
        self.advance: Callable[[int], None] = lambda n: None

    def __call__(self, event: str, amount: int, details: dict[str, Any]) -> None:
        if event in self.COUNTED:
            self.advance(amount)


class Pause:
    """Fault injection for the tests: ``WDSRAFT_CONVERT_PAUSE_AT=NAME:N`` makes the process write its
    pid to ``WDSRAFT_CONVERT_PAUSE_MARKER`` and sleep at the Nth event called NAME, so that a test can
    SIGKILL it at a known point. NAME is an event's first word (``spill``, ``unit``, ``shard``,
    ``bucket``), or that word and ``-unitU`` to count only the events of unit U (``spill-unit1``)."""

    def __init__(self, spec: str, marker: str | None):
        name, _, number = spec.partition(":")
        self.name = name
        self.number = int(number or 1)
        self.marker = marker
        self.count = 0

    def __call__(self, event: str, amount: int, details: dict[str, Any]) -> None:
        word = event.split()[0]
        names = (word, f"{word}-unit{details['unit']}") if "unit" in details else (word,)
        if self.name not in names:
            return
        self.count += 1
        if self.count == self.number:
            if self.marker:
                with open(self.marker, "w") as handle:
                    handle.write(str(os.getpid()))
            while True:
                time.sleep(60)


progress = Progress()
listen(progress)
if os.environ.get("WDSRAFT_CONVERT_PAUSE_AT"):  # (read at import: worker processes see it too, forked or spawned)
    listen(Pause(os.environ["WDSRAFT_CONVERT_PAUSE_AT"], os.environ.get("WDSRAFT_CONVERT_PAUSE_MARKER")))
