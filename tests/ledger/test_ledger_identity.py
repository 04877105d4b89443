"""The ledger records the dataset identity of the shards it names, and refuses another dataset under the
same shard names (a real re-conversion with another seed); unreadable ledger inputs name the file."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import msgpack
import pytest

import wdsraft as wds
from wdsraft.cli import main
from wdsraft.core.errors import LedgerError, StateMismatchError
from wdsraft.ledger.rank_file import RankFile

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings


def _convert(inputs: Path, output: Path, seed: int, *extra: str) -> list[str]:
    argv = ["convert", "-q", str(inputs), "-o", str(output), "--name", "ds", "--samples-per-shard", "10"]
    assert main([*argv, "--seed", str(seed), *extra]) == 0
    manifest_url = str(output / "manifest.json")
    return wds.Manifest.load(manifest_url).urls(manifest_url)


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"text": f"document {n} " * (1 + n % 7)}) + "\n" for n in range(60)))
    output = tmp_path / "ds"
    return inputs, output, _convert(inputs, output, seed=1)


def _loader(urls: list[str], seed: int, batch: int):
    dataset = wds.WebDataset(urls, shardshuffle=100, seed=seed).shuffle(10, seed=seed).batched(batch)
    return wds.WebLoader(dataset, batch_size=None, num_workers=0)


def _train(ledger: wds.Ledger, loader, stop: int) -> dict:
    for step, _batch in enumerate(ledger.track(loader), 1):
        if step == stop:
            return ledger.checkpoint(loader, step)
    raise AssertionError("the epoch ended first")


def test_a_re_converted_dataset_under_the_same_names_is_refused(dataset, tmp_path: Path, capsys) -> None:
    inputs, output, urls = dataset
    path = str(tmp_path / "ledger")
    saved = _train(wds.Ledger(path, run="one", rank=0, world_size=1), _loader(urls, 1, 4), stop=5)

    # Same dataset, changed batch size: the elastic resume goes on (the identities match).
    again = wds.Ledger(path, run="two", rank=0, world_size=1)
    assert again.resume(_loader(urls, 2, 5), saved) == "elastic"

    # Re-converted with another seed into the same names: other samples at the same positions.
    assert _convert(inputs, output, 2, "--overwrite") == urls
    refused = wds.Ledger(path, run="three", rank=0, world_size=1)
    with pytest.raises(StateMismatchError, match=r"ds-\d+\.tar: not the shard the ledger .* recorded") as error:
        refused.resume(_loader(urls, 2, 5), saved)
    assert "sha256" in str(error.value)

    # An exact resume (same configuration) is refused too: the shards of its last commit are checked.
    exact = wds.Ledger(path, run="four", rank=0, world_size=1)
    with pytest.raises(StateMismatchError, match=r"ds-\d+\.tar: not the shard"):
        exact.resume(_loader(urls, 1, 4), saved)

    # Any other shard, at the first commit that names it (before the checkpoint that would build on it).
    later = wds.Ledger(path, run="five", rank=0, world_size=1)
    later.consumed(0, saved["ledger"]["lineage"], saved["ledger"]["steps"])  # (learns what was recorded)
    recorded = {shard for f in later.rank_files() for c in f.commits for shard in c["shards"]}
    later.record({"__url__": [sorted(recorded)[-1]], "__ordinal__": [0]}, epoch=0)
    with pytest.raises(StateMismatchError, match=r"ds-\d+\.tar: not the shard"):
        later.commit(step=1)

    # `ledger show` says what it recorded, and with the manifest that the dataset differs.
    assert main(["ledger", "show", path, "--all-commits", "--shards"]) == 0
    shown = capsys.readouterr().out
    assert "dataset: " in shown and "shards identified" in shown and "[sha256 " in shown
    assert main(["ledger", "show", path, "--all-commits", "--manifest", str(output / "manifest.json")]) == 1
    shown = capsys.readouterr().out
    assert "DIFFERS from" in shown and "ds-" in shown and "another dataset" in shown


def test_a_fresh_ledger_on_the_re_converted_dataset_and_merge_keep_identities(dataset, tmp_path: Path) -> None:
    inputs, output, urls = dataset
    path = str(tmp_path / "ledger")
    _train(wds.Ledger(path, run="one", rank=0, world_size=1), _loader(urls, 1, 4), stop=3)
    assert main(["ledger", "merge", path, "--all-commits", "--output", str(tmp_path / "merged")]) == 0
    (merged,) = wds.Ledger(str(tmp_path / "merged"), run="x").rank_files()
    recorded = merged.commits[0]["shards"]
    assert recorded and all(url in urls for url in recorded)
    _convert(inputs, output, 3, "--overwrite")
    # The merged ledger kept the identities of the dataset it was written for: the new one is refused.
    with pytest.raises(StateMismatchError, match="not the shard"):
        saved = {"ledger": {"ledger": str(tmp_path / "merged"), "lineage": {"merged": 1}, "steps": {}, "epoch": 0}}
        saved["loader"] = {}
        wds.Ledger(str(tmp_path / "merged"), run="y", rank=0, world_size=1).resume(_loader(urls, 5, 3), saved)


def test_old_ledger_files_without_identities_load_with_one_warning(dataset, tmp_path: Path, caplog) -> None:
    _, _, urls = dataset
    path = tmp_path / "ledger"
    saved = _train(wds.Ledger(str(path), run="one", rank=0, world_size=1), _loader(urls, 1, 4), stop=4)
    (rank_path,) = path.glob("run-one/*.ledger")
    old = RankFile.parse(str(rank_path), rank_path.read_bytes())
    for commit in old.commits:
        del commit["shards"]  # as wdsraft wrote them before identities
    old.save()
    again = wds.Ledger(str(path), run="two", rank=0, world_size=1)
    with caplog.at_level(logging.WARNING, logger="wdsraft.ledger"):
        assert again.resume(_loader(urls, 2, 5), saved) == "elastic"
        again.consumed(0)
    warnings = [r for r in caplog.records if "records no dataset identity" in r.message]
    assert len(warnings) == 1 and str(rank_path) in warnings[0].message


def test_a_checksummed_ledger_file_of_the_wrong_structure_names_the_file(tmp_path: Path, capsys) -> None:
    good = RankFile(str(tmp_path / "l" / "run-x" / "rank-00000.ledger"), "x", 0, 1, {})
    good.commits = [{"commit": 1, "step": 1, "time": 0.0, "epochs": {"0": {"samples": ["not", "a map"]}}}]
    good.save()
    assert main(["ledger", "show", str(tmp_path / "l")]) == 1
    err = capsys.readouterr().err
    assert "rank-00000.ledger: checksum right but not the structure of a ledger file" in err and "samples" in err
    with pytest.raises(LedgerError, match=r"rank-00000\.ledger"):
        RankFile.parse(good.url, Path(good.url).read_bytes())
    # A body that is not even a map, checksummed.
    body = msgpack.packb([1, 2, 3])

    outer = {"format": "wdsraft-ledger", "version": 1, "sha256": hashlib.sha256(body).hexdigest(), "body": body}
    with pytest.raises(LedgerError, match=r"x\.ledger: checksum right .*not a map"):
        RankFile.parse("x.ledger", msgpack.packb(outer, use_bin_type=True))


def test_a_torch_checkpoint_or_a_non_utf8_manifest_given_to_ledger_show_names_the_file(tmp_path, capsys) -> None:
    import torch

    ledger = wds.Ledger(str(tmp_path / "l"), run="a", rank=0, world_size=1)
    ledger.record({"__url__": ["s.tar"], "__ordinal__": [0]}, epoch=0)
    ledger.commit(step=1)
    checkpoint = tmp_path / "step-100.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "step": 100}, checkpoint)
    assert main(["ledger", "show", str(checkpoint)]) == 1
    assert f"{checkpoint}: a file, not a ledger directory" in capsys.readouterr().err
    assert main(["ledger", "show", str(tmp_path / "l"), "--checkpoint", str(checkpoint)]) == 1
    assert f"{checkpoint}: no ledger watermark in this checkpoint" in capsys.readouterr().err
    assert main(["ledger", "show", str(tmp_path / "l"), "--manifest", str(checkpoint)]) == 1
    assert f"{checkpoint}: not a manifest: not UTF-8 text" in capsys.readouterr().err
    latin = tmp_path / "manifest.json"
    latin.write_bytes('{"name": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(wds.IndexFormatError, match=r"manifest.json: not a manifest: not UTF-8 text"):
        wds.Manifest.load(str(latin))


def test_identities_of_shards_on_s3(dataset, tmp_path: Path, s3_bucket, caplog) -> None:
    """Shards and their indexes on S3 (moto): identities are read through S3 and a replaced shard is named;
    a shard without an index on S3 is not checked, quietly (an unindexed webdataset corpus is normal)."""
    import boto3

    _, output, local = dataset
    client = boto3.client("s3")
    for path in sorted(output.glob("ds-*")):
        client.upload_file(str(path), s3_bucket, f"ds/{path.name}")
    urls = [f"s3://{s3_bucket}/ds/{Path(url).name}" for url in local]
    ledger_url = f"s3://{s3_bucket}/ledger"
    saved = _train(wds.Ledger(ledger_url, run="one", rank=0, world_size=1), _loader(urls, 1, 4), stop=4)
    (rank_file,) = wds.Ledger(ledger_url, run="x").rank_files()
    recorded = rank_file.commits[0]["shards"]
    assert set(recorded) <= set(urls) and all(len(item["sha256"]) == 64 for item in recorded.values())
    # One shard replaced by another (with its index) under the same name: refused, naming it.
    victim = sorted(recorded)[0]
    other = next(url for url in local if Path(url).name != Path(victim).name)
    client.upload_file(other, s3_bucket, f"ds/{Path(victim).name}")
    client.upload_file(other + ".idx", s3_bucket, f"ds/{Path(victim).name}.idx")
    with pytest.raises(StateMismatchError, match=f"{victim}: not the shard"):
        wds.Ledger(ledger_url, run="two", rank=0, world_size=1).resume(_loader(urls, 2, 5), saved)
    # Unindexed shards on S3: nothing recorded for them, no warning.
    plain = wds.Ledger(f"s3://{s3_bucket}/other-ledger", run="p", rank=0, world_size=1)
    plain.record({"__url__": [f"s3://{s3_bucket}/nowhere/a.tar"], "__ordinal__": [0]}, epoch=0)
    with caplog.at_level(logging.WARNING, logger="wdsraft.ledger"):
        plain.commit(step=1)
    assert not [r for r in caplog.records if r.name.startswith("wdsraft")]
    (plain_file,) = plain.rank_files()
    assert plain_file.commits[0]["shards"] == {}


def test_resume_names_what_it_was_given_instead_of_a_ledger_checkpoint(tmp_path: Path) -> None:
    ledger = wds.Ledger(str(tmp_path / "l"), run="a", rank=0, world_size=1)
    with pytest.raises(
        LedgerError, match=r"resume\(\) takes what Ledger.checkpoint\(\) returned .*\['data', 'model'\]"
    ):
        ledger.resume(_loader(["x.tar"], 1, 2), {"model": {}, "data": {}})  # the whole training checkpoint


def test_the_identity_of_a_pipe_shard_runs_no_command(tmp_path) -> None:
    """Identities come from the index beside a shard; for a ``pipe:`` shard there is none to look up, and the
    command with ".idx" appended must not run (it could download a whole shard, or worse)."""
    from wdsraft.ledger.identity import identity_of

    marker = tmp_path / "ran"
    assert identity_of(f"pipe:touch {marker}") is None
    assert not (tmp_path / "ran.idx").exists()
