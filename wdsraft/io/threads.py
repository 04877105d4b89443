"""Running one blocking call per object on a pool of threads, in order: reading many small objects
(indexes, ledger files) one after another costs a full round trip each (20-40 ms on an object store).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
U = TypeVar("U")

#: Calls at once, by default (S3 reads wait on the network, not on the GIL).
CONCURRENCY = 32


def map_in_threads(
    function: Callable[[U], T], items: Iterable[U], progress: str | None = None, concurrency: int = CONCURRENCY
) -> Iterator[T]:
    """``function(item)`` of each item, in order, at most ``concurrency`` at once; with ``progress``, a tqdm
    bar of that name where there are many. The first error is raised when its item's turn comes."""
    wanted = list(items)
    if len(wanted) <= 1:
        yield from map(function, wanted)
        return
    bar = None
    if progress is not None and len(wanted) >= 200:
        from tqdm import tqdm

        bar = tqdm(total=len(wanted), unit="file", desc=progress)
    with ThreadPoolExecutor(min(concurrency, len(wanted))) as pool:
        # Submitted in windows: a result is handed on (and its bytes dropped) while later calls run.
        window = 4 * concurrency
        futures = [pool.submit(function, item) for item in wanted[:window]]
        for index in range(len(wanted)):
            result = futures[index].result()
            futures[index] = None  # type: ignore[call-overload]
            if index + window < len(wanted):
                futures.append(pool.submit(function, wanted[index + window]))
            if bar is not None:
                bar.update(1)
            yield result
    if bar is not None:
        bar.close()
