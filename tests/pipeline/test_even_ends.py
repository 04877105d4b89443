"""Even ends across ranks: real processes in a gloo group, ranks holding uneven shard counts, a training
all_reduce at every step. Every rank leaves the epoch on the same step ("pad": the longest rank's,
"shortest": the shortest rank's) without hanging (collectives time out, so a hang fails the test), and
a state taken during the padding steps resumes into the same step count."""

from __future__ import annotations

import datetime
import multiprocessing
import queue
from typing import Any

import pytest
from shardutil import free_port

import wdsraft as wds
from wdsraft.testing import identity

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings

WORLD = 3
SHARDS_OF_RANK = {0: [0, 1, 2], 1: [3], 2: [4, 5]}  # 5 samples per shard: 4, 2 and 3 batches of 4
BATCHES = {0: 4, 1: 2, 2: 3}
CUT = {"pad": 3, "shortest": 1}  # where the resumed run starts (pad: rank 1 is padding there)


def _loader(urls: list[str], rank: int, ends: Any):
    mine = [urls[n] for n in SHARDS_OF_RANK[rank]]
    dataset = wds.WebDataset(mine, shardshuffle=False, nodesplitter=None).to_tuple("__key__").batched(4)
    return wds.WebLoader(dataset, batch_size=None, num_workers=0, even_ends=ends).unbatched().batched(4)


def _steps(loader, cut: int | None = None) -> tuple[list[Any], Any]:
    """Run an epoch with a training all_reduce per step; the items and the state after ``cut`` steps."""
    import torch
    import torch.distributed as dist

    items, state = [], None
    for item in loader:
        dist.all_reduce(torch.ones(1))  # the training step's collective
        items.append(None if item is None else identity(item))
        if len(items) == cut:
            state = loader.state_dict()
    return items, state


def _rank(rank: int, port: int, urls: list[str], out) -> None:
    import torch.distributed as dist

    from wdsraft.pipeline import ends

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=20),  # a hang raises in the ranks instead of waiting for ever
    )
    try:
        results: dict[str, Any] = {}
        calls = [0]
        reduce = dist.all_reduce

        def counted(*args: Any, **kw: Any) -> Any:
            calls[0] += 1
            return reduce(*args, **kw)

        dist.all_reduce = counted  # type: ignore[assignment]
        for mode in ("pad", "shortest"):
            whole, state = _steps(_loader(urls, rank, mode), CUT[mode])
            again = _loader(urls, rank, mode)
            again.load_state_dict(state)
            rest, _ = _steps(again)
            results[mode] = (whole, rest)
        # Known lengths: one exchange when the epoch starts, none per step.
        calls[0] = 0
        whole, state = _steps(_loader(urls, rank, wds.EvenEnds("pad", length=BATCHES[rank])), CUT["pad"])
        results["length"] = (whole, calls[0] - len(whole))
        again = _loader(urls, rank, wds.EvenEnds("pad", length=BATCHES[rank]))
        again.load_state_dict(state)
        results["length resumed"] = _steps(again)[0]
        # A length below the real count: found at the epoch's end, after the agreed steps; every rank raises.
        results["understated"] = _error(lambda: _steps(_loader(urls, rank, _said(rank, "pad", 0, -1))))
        # "shortest": a rank that gave the shortest length but has more (the others stopped early with it).
        results["understated shortest"] = _error(lambda: _steps(_loader(urls, rank, _said(rank, "shortest", 1, -1))))
        # "shortest" with lengths above every real count: each rank runs out before the agreed steps and says
        # so, never handing out None. (No training collective: the ranks run out at different steps.)
        overstated = _loader(urls, rank, wds.EvenEnds("shortest", length=9))
        results["overstated shortest"] = _error(lambda: [identity(item) for item in overstated])
        # A rank whose length cannot be had, and a rank whose batches raise: every rank raises with it.
        results["length raises"] = _error(lambda: _steps(_loader(urls, rank, _said(rank, "pad", 2, None))))
        for mode in ("pad", "shortest"):
            results[f"raises {mode}"] = _error(lambda mode=mode: _steps(wds.even_ends(_failing(rank), mode)))
        results["ledger"] = _shortest_under_a_ledger(urls, rank)
        # A default group that is not gloo (NCCL on GPUs): the flag goes over a gloo twin made once.
        dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment]
        whole, _ = _steps(_loader(urls, rank, "pad"))
        results["twin"] = (whole, len(ends._side_groups))
        out.put((rank, results))
        dist.barrier()
    except BaseException as exn:
        out.put((rank, repr(exn)))
        raise
    finally:
        dist.destroy_process_group()


def _ledger_loader(urls: list[str], ends: Any):
    dataset = wds.WebDataset(urls, shardshuffle=False, nodesplitter=None).batched(4)
    return wds.WebLoader(dataset, batch_size=None, num_workers=0, even_ends=ends)


def _delivered(batch: Any) -> list[tuple[str, str]]:
    return list(zip(batch["__url__"], batch["__key__"], strict=True))


def _shortest_under_a_ledger(urls: list[str], rank: int) -> tuple[list[Any], Any]:
    """An epoch with "shortest" through a ledger, checkpointed where every rank stopped: what was delivered,
    and the checkpoint's data."""
    import os

    import torch
    import torch.distributed as dist

    path = os.path.join(os.path.dirname(urls[0]), "ledger-shortest")
    ledger = wds.Ledger(path, run="one", rank=rank, world_size=WORLD)
    loader = _ledger_loader([urls[n] for n in SHARDS_OF_RANK[rank]], "shortest")
    delivered, step = [], 0
    for batch in ledger.track(loader):
        dist.all_reduce(torch.ones(1))
        delivered += _delivered(batch)
        step += 1
    return delivered, ledger.checkpoint(loader, step)


def _said(rank: int, mode: str, liar: int, change: int | None) -> Any:
    """Even ends with every rank giving its true length, but rank ``liar`` off by ``change`` (None: raises)."""

    def length(epoch: int) -> int:
        if rank != liar:
            return BATCHES[rank]
        if change is None:
            raise OSError("the length file is missing")
        return BATCHES[rank] + change

    return wds.EvenEnds(mode, length=length)


def _failing(rank: int):
    """Three batches, but rank 1's second raises."""
    for step in range(3):
        if rank == 1 and step == 1:
            raise OSError("rank 1 cannot read its shard")
        yield [step]


def _error(run: Any) -> str | None:
    """What ``run`` raised (type and message), or None."""
    try:
        run()
    except Exception as exn:
        return f"{type(exn).__name__}: {exn}"
    return None


@pytest.fixture(scope="module")
def runs(write_shards) -> dict[int, Any]:
    urls = write_shards("even", [{"txt": f"s{n}"} for n in range(30)], 5)
    context = multiprocessing.get_context("spawn")
    port, out = free_port(), context.Queue()
    processes = [context.Process(target=_rank, args=(rank, port, urls, out)) for rank in range(WORLD)]
    for process in processes:
        process.start()
    try:
        results = dict(out.get(timeout=90) for _ in processes)
    except queue.Empty:
        pytest.fail("a rank hung at the end of an epoch")
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    for rank, result in results.items():
        assert not isinstance(result, str), f"rank {rank}: {result}"
    return results


def _alone(write_shards, rank: int) -> list[Any]:
    """What the rank's loader gives without a process group: its own batches."""
    urls = write_shards("even", [{"txt": f"s{n}"} for n in range(30)], 5)
    return [identity(b) for b in _loader(urls, rank, None)]


def test_pad_gives_every_rank_the_longest_ranks_steps(runs, write_shards) -> None:
    for rank in range(WORLD):
        whole, _ = runs[rank]["pad"]
        assert whole == _alone(write_shards, rank) + [None] * (4 - BATCHES[rank]), rank


def test_shortest_stops_every_rank_with_the_shortest(runs, write_shards) -> None:
    for rank in range(WORLD):
        whole, _ = runs[rank]["shortest"]
        assert whole == _alone(write_shards, rank)[:2], rank


@pytest.mark.parametrize("mode", ["pad", "shortest", "length"])
def test_a_state_taken_while_padding_resumes_into_the_same_step_count(runs, mode) -> None:
    for rank in range(WORLD):
        whole, rest = runs[rank][mode]
        if mode == "length":
            whole, rest = whole, runs[rank]["length resumed"]
        assert rest == whole[CUT.get(mode, 3) :], (rank, mode)


def test_known_lengths_exchange_twice_per_epoch(runs, write_shards) -> None:
    for rank in range(WORLD):
        whole, exchanges = runs[rank]["length"]
        assert whole == _alone(write_shards, rank) + [None] * (4 - BATCHES[rank])
        assert exchanges == 2, rank  # (the lengths at the start, the check at the end)


def test_a_non_gloo_group_sends_the_flag_over_a_gloo_twin(runs, write_shards) -> None:
    for rank in range(WORLD):
        whole, twins = runs[rank]["twin"]
        assert whole == _alone(write_shards, rank) + [None] * (4 - BATCHES[rank])
        assert twins == 1


def test_even_ends_stays_the_last_stage_and_checks_its_mode(write_shards) -> None:
    urls = write_shards("even", [{"txt": f"s{n}"} for n in range(30)], 5)
    loader = _loader(urls, 0, "shortest")
    assert loader.pipeline[-1] is loader.even_ends and len(loader.pipeline) == 4
    with pytest.raises(ValueError, match="shortest"):
        wds.WebLoader(wds.WebDataset(urls, shardshuffle=False), even_ends="longest")
    assert list(wds.even_ends(iter([1, 2]), "shortest")) == [1, 2]  # no process group: untouched


def test_a_length_below_the_real_count_is_an_error_on_every_rank(runs) -> None:
    assert runs[0]["understated"].startswith("ValueError: even ends: this rank has more than the 3 batches")
    for rank in (1, 2):  # (before, they went on to the next epoch and waited for rank 0 until the timeout)
        assert runs[rank]["understated"].startswith("RankFailedError: even ends: rank 0 of the group failed"), rank


def test_shortest_checks_the_length_of_the_rank_that_gave_the_shortest(runs) -> None:
    # Rank 1 said 1 batch (it has 2): every rank stopped after one step; before, silently.
    assert runs[1]["understated shortest"].startswith("ValueError: even ends: this rank has more than the 1 batches")
    for rank in (0, 2):
        assert runs[rank]["understated shortest"].startswith("RankFailedError: even ends: rank 1"), rank


def test_shortest_never_pads_a_rank_whose_length_was_too_long(runs) -> None:
    # Before, each rank got None batches up to the agreed 9 steps (with a warning).
    for rank in range(WORLD):
        assert runs[rank]["overstated shortest"] == (
            f"ValueError: even ends: this rank ran out after {BATCHES[rank]} batches, before the 9 steps the "
            "shortest length said (it gave 9): the length it gave is wrong"
        ), rank


def test_a_rank_that_fails_makes_every_rank_raise(runs) -> None:
    assert runs[2]["length raises"] == "OSError: the length file is missing"
    for rank in (0, 1):
        assert runs[rank]["length raises"] == (
            "RankFailedError: even ends: rank 2 of the group failed to give its length; this rank stops with it"
        )
    for mode in ("pad", "shortest"):  # the per-step flag: before, ranks 0 and 2 waited until the timeout
        assert runs[1][f"raises {mode}"] == "OSError: rank 1 cannot read its shard"
        for rank in (0, 2):
            assert runs[rank][f"raises {mode}"] == (
                "RankFailedError: even ends: rank 1 of the group failed to read its next batch; this rank stops with it"
            ), (rank, mode)


def test_even_ends_costs_the_loader_no_snapshots(write_shards) -> None:
    """The stage holds no items, so the loader keeps no per-batch states for re-reading them."""
    urls = write_shards("even", [{"txt": f"s{n}"} for n in range(30)], 5)
    dataset = wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__").batched(4)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=0, even_ends="pad")
    source = loader.pipeline[0]
    for _ in loader:
        assert not source._snapshots


def test_what_shortest_drops_is_not_consumed_and_an_elastic_resume_serves_it(runs) -> None:
    """Three ranks stop together at the shortest rank's 2 steps: the ledger counts only what was handed out,
    so one rank resuming the epoch elastically serves exactly the samples the longer ranks never delivered."""
    import glob
    import os

    saved = runs[0]["ledger"][1]
    path = saved["ledger"]["ledger"]  # (the ranks' ledger, beside their shards)
    urls = sorted(glob.glob(os.path.join(os.path.dirname(path), "even-*.tar")))
    delivered = [pair for rank in range(WORLD) for pair in runs[rank]["ledger"][0]]
    assert len(delivered) == 8 + 5 + 8  # every rank its first 2 batches (rank 1's: 4 + 1 samples)
    ledger = wds.Ledger(path, run="two", rank=0, world_size=1)
    loader = _ledger_loader(urls, "shortest")
    assert ledger.resume(loader, saved) == "elastic"
    rest = [pair for batch in ledger.track(loader) for pair in _delivered(batch)]
    assert len(rest) == 30 - len(delivered) and len(set(delivered + rest)) == 30  # each sample once
