"""Plain functions placed after a stage that hands items out one by one (``shuffle``, ``parallel_map``,
``batched``): a state cannot see the rest of an item such a function is part-way through splitting, so a
pipeline seen splitting there refuses its states instead of resuming without the rest (or with it twice).

Right after the source the pass resumes such splits exactly (``wdsraft.pipeline.partial``). Further down
it only watches: the functions of a run that may yield several items per item are wrapped, on the way in
and on the way out, and a second item out before the next one in marks the run as splitting.

A state asked for right after the first item out for an item cannot tell from what went by whether more
will come. The pass then pulls the run's next item (``Lookahead``), after taking the stages' states: from
the same item, the run splits and the state is refused; from the next one, the state is exact. The item
pulled is handed out next, as if never pulled, and until then the states of the stages before the run are
the ones taken before the pull (the pull moved them on).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from webdataset.handlers import reraise_exception

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
        "_decode",
        "_log_keys",
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


#: webdataset's filters that drop an item by design (a predicate that says no, a function or decoder that
#: returns None); any of its filters drops one whose error a handler skips (not the default, which raises).
MAY_DROP = frozenset({"_select", "_map", "_decode"})


def may_drop(functions: list[Any]) -> bool:
    """Whether one of ``functions`` may drop an item: not one of webdataset's filters known to keep every item."""
    return any(map(_may_drop, functions))  # (no generator frame: runs at every pass of every source)


def _may_drop(function: Any) -> bool:
    if not at_most_one_per_item(function):
        return True  # (any other function: who knows)
    handler = getattr(function, "kw", {}).get("handler", reraise_exception)
    return function.f.__name__ in MAY_DROP or handler is not reraise_exception


def may_split(functions: list[Any]) -> bool:
    """Whether one of ``functions`` may give several items for one (not one of webdataset's one-for-one filters)."""
    return not all(map(at_most_one_per_item, functions))  # (no generator frame: runs at every pass of every source)


#: What ``Lookahead.held`` holds where the run had no next item.
END = object()


class Lookahead:
    """The item a state pulled out of a run of plain functions to learn whether the run was done with the item
    it was on; handed out next (by the run's last wrapper), as if never pulled. ``state``: the stage states
    taken before the pull (those of the stages before ``first`` still stand while the item is held)."""

    __slots__ = ("ctx", "first", "held", "items", "seeds", "stamp", "state")

    def __init__(self, first: int, ctx: Any) -> None:
        self.first = first  # index of the run's first function
        self.ctx = ctx  # (the pass's Context: the stamp the item came out under goes out with it)
        self.items: Iterator[Any] | None = None  # what the run gives (set as its wrapper starts)
        self.held: list[Any] = []  # the item pulled (END, or a _Raised), until handed out
        self.stamp: tuple[Any, int] = (None, 0)
        self.state: dict[str, Any] = {}
        #: The seeds and live RNGs the stages before the run had drawn before the pull (the pipeline's own
        #: record of what carries over from one pass to the next), to put back if the item never goes out.
        self.seeds: dict[str, Any] = {}

    def pull(self, state: dict[str, Any]) -> bool:
        """Pull the run's next item and hold it, ``state`` (taken before) kept; whether an item came (not the
        run's end or an error: held too, to end the run or raise when the item would have been pulled)."""
        if self.items is None or self.held:
            return False
        self.state = state
        ctx = self.ctx
        before = ctx.provenance, ctx.serial
        try:
            self.held.append(next(self.items))
        except StopIteration:
            self.held.append(END)
        except Exception as error:
            self.held.append(_Raised(error))
        # The stages after the run see the item with the stamp it came out under, when it goes out; until then
        # they see what they saw before the pull (a stage part-way through handing out puts it back anyway).
        self.stamp = ctx.provenance, ctx.serial
        ctx.provenance, ctx.serial = before
        return self.held[0] is not END and not isinstance(self.held[0], _Raised)

    @property
    def raised(self) -> bool:
        """Whether the pull met an error (held, to be raised where the item would have been pulled)."""
        return bool(self.held) and isinstance(self.held[0], _Raised)

    def take(self) -> Any:
        """The item held, now handed out (END: the run is over)."""
        held = self.held.pop()
        self.state = {}
        self.ctx.provenance, self.ctx.serial = self.stamp
        if isinstance(held, _Raised):
            raise held.error
        return held


def states_before(states: dict[str, Any], first: int) -> dict[str, Any]:
    """A copy of the states of the stages before index ``first`` (and of where the source's plain functions
    are): what ``Lookahead`` keeps while it holds an item."""
    return {
        key: copy.deepcopy(value)
        for key, value in states.items()
        if key == "partial" or (key.isdigit() and int(key) < first)
    }


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class SplitWatch:
    """One run of plain functions after a stage: whether it was seen yielding several items for one, and
    (``drops_matter``: between a stage that splits items and one that holds them) dropping one."""

    def __init__(
        self,
        names: list[str],
        drops_matter: bool = False,
        around: str = "",
        first: int = 0,
        splits: bool = True,
        ctx: Any = None,
    ):
        self.names = names
        self.splits = splits  # (False: its functions give at most one item per item; watched for drops only)
        self.drops_matter = drops_matter
        self.around = around  # "stage N (unlisted) and stage M (shuffle)", for the refusal
        self.out = 0  # items out since the last one in
        self.pulls = 0
        self.split = False
        self.dropped = False
        self.ahead = Lookahead(first, ctx)

    def unsure(self) -> bool:
        """Whether a state now could be part-way through an item (one item out for it, a second may come)."""
        return self.splits and self.out == 1 and not self.split and not self.ahead.held

    def peek(self, state: dict[str, Any]) -> bool:
        """Pull the run's next item (see ``Lookahead``); whether it came from the same item as the one before
        (or an error did: the item was not done with, so a restore after it could not give its rest)."""
        pulls = self.pulls
        if not self.ahead.pull(state):
            if self.ahead.raised and self.pulls == pulls:
                self.split = True
            return self.split
        self.out += 1  # (counted here: ``given`` hands it out without counting it again)
        if self.out > 1:
            self.split = True
        return self.split

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
        """What comes out of the run (a second item before the next one in is a split), and what a state pulled."""
        ahead = self.ahead
        ahead.items = items = iter(items)
        for item in items:
            self.out += 1
            if self.out > 1:
                self.split = True
            yield item
            while ahead.held:  # (a state pulled the next item: it goes out now)
                held = ahead.take()
                if held is END:
                    return
                yield held

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
    stages: list[Any],
    start: int,
    is_stage: Any,
    drops_matter: Any = lambda before, after: False,
    drops_matter_far: Any = lambda first, end: False,
) -> dict[int, tuple[int, list[Any], bool]]:
    """The runs of plain functions from ``start`` on to watch: first index -> (end, functions, drops matter).
    Watched: those that may split items, and those between two stages for which ``drops_matter(before, after)``
    (a stage that splits items and one that holds them). Drops matter too in a run watched anyway for which
    ``drops_matter_far(first, end)`` (a split anywhere before, a holder anywhere after: a run that may split is
    watched anyway; a run of webdataset's filters there is watched only if one of them may drop an item:
    ``select``, ``map`` returning None... two generators per item, where a drop would resume wrong)."""
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
        splits = may_split(functions)
        drops = drops or ((splits or may_drop(functions)) and drops_matter_far(index, end))
        if drops or splits:
            runs[index] = (end, functions, drops)
        index = end
    return runs


def dropping_stages(
    stages: list[Any], is_stage: Any, splits: Any, holds: Any, split_at: int = -1
) -> dict[int, tuple[int, bool]]:
    """Stages that drop items (``drops_none``: ``parallel_filter_map``) after one that splits items
    (``splits(stage)``, however far before: the stages between pass its numbering on; or from index
    ``split_at`` on, the first stage after plain functions that may split the source's items) and before one
    that holds items (``holds(stage)``): index -> (the holder's index, whether a splitting stage is before it).
    As for a plain filter there, a drop makes states refused (the holder numbers the items it received)."""
    found: dict[int, tuple[int, bool]] = {}
    for index, stage in enumerate(stages):
        if not getattr(stage, "drops_none", False):
            continue
        by_stage = any(is_stage(before) and splits(before) for before in stages[:index])
        holder = next((i for i in range(index + 1, len(stages)) if is_stage(stages[i]) and holds(stages[i])), None)
        if (by_stage or 0 <= split_at <= index) and holder is not None:
            found[index] = (holder, by_stage)
    return found
