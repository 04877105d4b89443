"""Plain functions placed after a stage that hands items out one by one (``shuffle``, ``parallel_map``,
``batched``): a state cannot see the rest of an item such a function is part-way through splitting, so a
pipeline seen splitting there refuses its states instead of resuming without the rest (or with it twice).

Right after the source the pass resumes such splits exactly (``wdsraft.pipeline.partial``). Further down
it only watches: the functions of a run that may yield several items per item are wrapped, on the way in
and on the way out, and a second item out before the next one in marks the run as splitting.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

#: webdataset's filters that give at most one item per item: never watched (no cost per item).
AT_MOST_ONE_PER_ITEM = frozenset(
    {
        "_map",
        "_map_dict",
        "_map_tuple",
        "_to_tuple",
        "_select",
        "_rename",
        "_rename_keys",
        "_xdecode",
        "_extract_keys",
        "_associate",
        "_info",
        "_slice",
    }
)


def at_most_one_per_item(function: Any) -> bool:
    """Whether ``function`` is one of webdataset's filters known to give at most one item per item."""
    inner = getattr(function, "f", None)
    return (
        getattr(inner, "__module__", None) == "webdataset.filters"
        and getattr(inner, "__name__", None) in AT_MOST_ONE_PER_ITEM
    )


def may_split(functions: list[Any]) -> bool:
    """Whether one of ``functions`` may give several items for one (not one of webdataset's one-for-one filters)."""
    return not all(map(at_most_one_per_item, functions))  # (no generator frame: runs at every pass of every source)


class SplitWatch:
    """One run of plain functions after a stage: whether it was seen yielding several items for one, and
    (``drops_matter``: between a stage that splits items and one that holds them) dropping one."""

    def __init__(self, names: list[str], drops_matter: bool = False, around: str = ""):
        self.names = names
        self.drops_matter = drops_matter
        self.around = around  # "stage N (unlisted) and stage M (shuffle)", for the refusal
        self.out = 0  # items out since the last one in
        self.pulls = 0
        self.split = False
        self.dropped = False

    @property
    def refused(self) -> bool:
        return self.split or (self.drops_matter and self.dropped)

    def pulled(self, items: Iterator[Any]) -> Iterator[Any]:
        """What goes into the run (an item in resets the count; one in with none out since the last is a drop)."""
        for item in items:
            if self.pulls and not self.out:
                self.dropped = True
            self.pulls += 1
            self.out = 0
            yield item

    def given(self, items: Iterator[Any]) -> Iterator[Any]:
        """What comes out of the run (a second item before the next one in is a split)."""
        for item in items:
            self.out += 1
            if self.out > 1:
                self.split = True
            yield item

    def refusal(self) -> str:
        if not self.split:
            return (
                f"cannot save this pipeline: a function between {self.around} ({', '.join(self.names)}) dropped an "
                "item of a split group, and the buffer numbers the items it kept where a restore re-reads them all, "
                "so it would restore other items; filter before the split or after the buffering stage"
            )
        return (
            f"cannot save this pipeline: a plain function after a stage ({', '.join(self.names)}) yields several "
            "items per item, and no state sees the rest of the item it is part-way through, so a restore would "
            "lose or repeat it; make the split a stage (wds.map(to_list) then wds.unlisted()), or split before "
            "the stage"
        )


def plain_runs(
    stages: list[Any], start: int, is_stage: Any, drops_matter: Any = lambda before, after: False
) -> dict[int, tuple[int, list[Any], bool]]:
    """The runs of plain functions from ``start`` on to watch: first index -> (end, functions, drops matter).
    Watched: those that may split items, and those between two stages for which ``drops_matter(before, after)``
    (a stage that splits items and one that holds them)."""
    runs: dict[int, tuple[int, list[Any], bool]] = {}
    index = start
    while index < len(stages):
        if is_stage(stages[index]):
            index += 1
            continue
        end = index
        while end < len(stages) and not is_stage(stages[end]):
            end += 1
        functions = stages[index:end]
        drops = index > 0 and end < len(stages) and drops_matter(stages[index - 1], stages[end])
        if drops or may_split(functions):
            runs[index] = (end, functions, drops)
        index = end
    return runs
