"""Running jobs in this process or in a pool of worker processes, with a progress bar fed by the
``progress`` listener of the jobs' events (through a counter the workers share).
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, TypeVar

from wdsraft.convert import events


def _shared_counter(counter: Any) -> Callable[[int], None]:
    def advance(n: int) -> None:
        with counter.get_lock():
            counter.value += n

    return advance


def _init_worker(counter: Any) -> None:
    events.progress.advance = _shared_counter(counter)


T = TypeVar("T")


class JobRunner:
    """Runs jobs in this process (one worker) or in a process pool, with a tqdm bar fed by the jobs.

    On the first failure the jobs not yet started are cancelled, running ones finish (their work
    is kept for the next run), and the error is raised.
    """

    def __init__(self, workers: int, progress: bool):
        self.workers = workers
        self.progress = progress

    def run(
        self,
        function: Callable[..., T],
        jobs: Sequence[tuple[Any, ...]],
        description: str,
        total: int,
        unit: str,
        on_done: Callable[[T], None] | None = None,
    ) -> list[T]:
        from tqdm import tqdm

        bar = tqdm(
            total=total, desc=description, unit=unit, unit_scale=True, disable=not self.progress, file=sys.stderr
        )
        results: list[T] = []
        try:
            if self.workers == 1 or len(jobs) <= 1:

                def advance(n: int) -> None:
                    bar.update(n)

                saved, events.progress.advance = events.progress.advance, advance
                try:
                    for job in jobs:
                        result = function(*job)
                        results.append(result)
                        if on_done:
                            on_done(result)
                finally:
                    events.progress.advance = saved
                return results
            context = multiprocessing.get_context()  # the platform's default start method
            counter = context.Value("q", 0)
            with ProcessPoolExecutor(
                max_workers=min(self.workers, len(jobs)),
                mp_context=context,
                initializer=_init_worker,
                initargs=(counter,),
            ) as pool:
                pending: set[Future[T]] = {pool.submit(function, *job) for job in jobs}
                shown = 0
                try:
                    while pending:
                        done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                        value = counter.value
                        bar.update(value - shown)
                        shown = value
                        for future in done:
                            result = future.result()
                            results.append(result)
                            if on_done:
                                on_done(result)
                except BaseException:
                    for future in pending:
                        future.cancel()
                    raise
            return results
        finally:
            bar.close()
