"""The ``wdsraft`` command line as a user meets it: --version, ``python -m wdsraft``, global options
after the command, one-line errors, Ctrl-C, help texts; and the SLURM scripts run outside SLURM."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from shardutil import corpus_samples

import wdsraft
from wdsraft import cli

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def wdsraft_process(*argv: str, **kwargs) -> subprocess.CompletedProcess[str]:
    """``python -m wdsraft ARGV`` with this checkout's package."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [PYTHON, "-m", "wdsraft", *argv], capture_output=True, text=True, cwd=REPO, env=env, timeout=120, **kwargs
    )


def assert_one_line_error(err: str, fragment: str, prefix: str = "wdsraft: error: ") -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix) and "Traceback" not in err, err
    assert fragment in lines[0], err


@pytest.fixture
def files(tmp_path: Path, corpus_records) -> dict[str, str]:
    """A shard with its index, one without, a ledger, a checkpoint, and files that are none of these."""
    shard = tmp_path / "shard.tar"
    with wdsraft.TarWriter(str(shard)) as sink:
        for sample in corpus_samples(corpus_records, 12):
            sink.write(sample)
    wdsraft.build_index(str(shard)).save(str(shard))
    bare = tmp_path / "bare.tar"
    bare.write_bytes(shard.read_bytes())
    Path(str(bare) + ".idx").unlink(missing_ok=True)
    random_file = tmp_path / "random.bin"
    # Seeded: about one random file in ten is not a torch UnpicklingError but an IndexError or a KeyError.
    random_file.write_bytes(random.Random(0).randbytes(3000))
    ledger = wdsraft.Ledger(str(tmp_path / "ledger"), run="a", rank=0, world_size=1)
    ledger.record({"__url__": [str(shard)] * 2, "__ordinal__": [0, 1]}, epoch=0)
    watermark = ledger.commit(step=1)
    checkpoint = tmp_path / "step-1.json"
    checkpoint.write_text(json.dumps({"step": 1, "data": {"ledger": watermark}}))
    garbage_ledger = tmp_path / "garbage-ledger" / "run-x"
    garbage_ledger.mkdir(parents=True)
    (garbage_ledger / "rank-00000.ledger").write_bytes(random.Random(1).randbytes(100))
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    manifest = tmp_path / "manifest.json"
    manifest.write_bytes(b'\xff\xfe{"shardlist": []}')
    bad_checkpoint = tmp_path / "bad.json"
    bad_checkpoint.write_bytes(b"\xff\xfe not json")
    no_watermark = tmp_path / "no-watermark.json"
    no_watermark.write_text(json.dumps({"step": 1, "model": {}}))
    bad_watermark = tmp_path / "bad-watermark.json"
    bad_watermark.write_text(json.dumps({"step": 1, "data": {"ledger": "l", "lineage": 5}}))
    rank_file = next((tmp_path / "ledger").glob("run-*/*.ledger"))
    return {
        "tmp": str(tmp_path),
        "shard": str(shard),
        "bare": str(bare),
        "random": str(random_file),
        "ledger": str(tmp_path / "ledger"),
        "checkpoint": str(checkpoint),
        "garbage_ledger": str(tmp_path / "garbage-ledger"),
        "latin1": str(latin1),
        "manifest": str(manifest),
        "bad_checkpoint": str(bad_checkpoint),
        "no_watermark": str(no_watermark),
        "bad_watermark": str(bad_watermark),
        "rank_file": str(rank_file),
    }


# -- --version and python -m wdsraft -------------------------------------------------------------


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"wdsraft {wdsraft.__version__}\n"


def test_python_m_wdsraft_is_the_command(files, capsys) -> None:
    for module in ("wdsraft", "wdsraft.cli"):
        shown = subprocess.run(
            [PYTHON, "-m", module, "--version"], capture_output=True, text=True, cwd=REPO, check=True
        ).stdout
        assert shown == f"wdsraft {wdsraft.__version__}\n"
    assert cli.main(["ls", files["shard"], "--limit", "3"]) == 0
    in_process = capsys.readouterr().out
    process = wdsraft_process("ls", files["shard"], "--limit", "3")
    assert process.returncode == 0 and process.stdout == in_process and len(in_process.splitlines()) == 4


# -- global options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "ls", "x"],
        ["ls", "x", "-v"],
        ["ls", "-v", "x"],
        ["--verbose", "convert", "in.jsonl", "-o", "out"],
        ["convert", "in.jsonl", "-o", "out", "--verbose"],
        ["-v", "ledger", "show", "p"],
        ["ledger", "-v", "show", "p"],
        ["ledger", "show", "p", "-v"],
        ["index", "-v", "x.tar"],
    ],
)
def test_global_options_go_before_or_after_the_command(argv: list[str]) -> None:
    args = cli.build_parser().parse_args(argv)
    assert args.verbose is True and args.quiet is False and args.debug is False


def test_a_global_option_before_the_command_is_not_reset_by_it() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["-q", "--debug", "ledger", "export", "p"])
    assert args.quiet and args.debug and not args.verbose
    args = parser.parse_args(["-q", "convert", "in", "-o", "out", "-v"])
    assert args.quiet and args.verbose and not args.debug
    args = parser.parse_args(["ls", "x"])
    assert not (args.quiet or args.verbose or args.debug)


def test_commands_run_with_global_options_after_them(files, tmp_path, capsys) -> None:
    assert cli.main(["ls", files["shard"], "-v", "--limit", "1", "--debug"]) == 0
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {n}"}) + "\n" for n in range(20)))
    assert cli.main(["convert", str(jsonl), "-o", str(tmp_path / "out"), "-v", "-q", "--workers", "1"]) == 0
    assert "20 samples" in capsys.readouterr().out
    assert cli.main(["ledger", "show", files["ledger"], "-v"]) == 0


# -- errors: one line, no traceback --------------------------------------------------------------


USER_ERRORS: list[tuple[str, Callable[[dict[str, str]], list[str]], str]] = [
    ("nonexistent shard", lambda f: ["ls", f["tmp"] + "/missing.tar"], "missing.tar: No such file or directory"),
    ("random file as a shard", lambda f: ["ls", f["random"]], "at byte offset 0"),
    ("no index to seek through", lambda f: ["ls", f["bare"], "--ordinal", "3"], "no index"),
    ("ordinal past the end", lambda f: ["ls", f["shard"], "--ordinal", "99"], "sample 99 out of range"),
    ("a glob that matches nothing", lambda f: ["index", f["tmp"] + "/nothing-*.tar"], "no shards match"),
    ("nonexistent input", lambda f: ["convert", f["tmp"] + "/no.jsonl", "-o", f["tmp"] + "/o", "-q"], "not found"),
    ("non-UTF-8 input", lambda f: ["convert", f["latin1"], "-o", f["tmp"] + "/o", "-q"], "not valid UTF-8"),
    (
        "non-UTF-8 manifest",
        lambda f: ["ledger", "show", f["ledger"], "--manifest", f["manifest"]],
        "manifest.json: not a manifest: not UTF-8",
    ),
    ("random file as a ledger", lambda f: ["ledger", "show", f["random"]], "a file, not a ledger directory"),
    ("checkpoint as a ledger", lambda f: ["ledger", "export", f["checkpoint"]], "a file, not a ledger directory"),
    ("nonexistent ledger", lambda f: ["ledger", "merge", f["tmp"] + "/nope", "--output", "x"], "no such ledger"),
    ("garbage rank file", lambda f: ["ledger", "export", f["garbage_ledger"]], "unreadable ledger file"),
    (
        "random file as a checkpoint",
        lambda f: ["ledger", "export", f["ledger"], "--checkpoint", f["random"]],
        "not a checkpoint torch.load can read (UnpicklingError",
    ),
    (
        "rank file as a checkpoint",
        lambda f: ["ledger", "show", f["ledger"], "--checkpoint", f["rank_file"]],
        "a ledger rank file, not a checkpoint",
    ),
    (
        "non-UTF-8 JSON checkpoint",
        lambda f: ["ledger", "rewind", f["ledger"], "--checkpoint", f["bad_checkpoint"]],
        "not a JSON checkpoint",
    ),
    (
        "nonexistent checkpoint",
        lambda f: ["ledger", "show", f["ledger"], "--checkpoint", f["tmp"] + "/no.pt"],
        "no.pt: No such file or directory",
    ),
    (
        "checkpoint without a watermark",
        lambda f: ["ledger", "show", f["ledger"], "--checkpoint", f["no_watermark"]],
        "no ledger watermark in this checkpoint",
    ),
    (
        "malformed watermark",
        lambda f: ["ledger", "show", f["ledger"], "--checkpoint", f["bad_watermark"]],
        "watermark in this checkpoint is malformed",
    ),
]


@pytest.mark.parametrize(("argv", "fragment"), [c[1:] for c in USER_ERRORS], ids=[c[0] for c in USER_ERRORS])
def test_user_errors_are_one_line(files, capsys, argv, fragment: str) -> None:
    assert cli.main(argv(files)) == 1
    captured = capsys.readouterr()
    assert_one_line_error(captured.err, fragment)


def test_debug_shows_the_traceback(files) -> None:
    with pytest.raises(FileNotFoundError):
        cli.main(["ls", files["tmp"] + "/missing.tar", "--debug"])
    with pytest.raises(wdsraft.LedgerError, match="a file, not a ledger directory"):
        cli.main(["--debug", "ledger", "show", files["random"]])


def test_bugs_keep_their_traceback(monkeypatch) -> None:
    def broken(args: argparse.Namespace) -> int:
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "cmd_ls", broken)
    with pytest.raises(KeyError):
        cli.main(["ls", "x"])


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["convert", "in.jsonl"], "required: -o/--output"),
        (["ls"], "required: URL"),
        (["nosuch"], "invalid choice: 'nosuch'"),
        (["ls", "x", "--ordinal", "abc"], "invalid int value: 'abc'"),
        (["ledger", "show"], "required: path"),
        (["ledger", "show", "p", "--lineage", "a"], "--lineage"),
        (["convert", "in", "-o", "o", "--memory", "lots"], "--memory"),
        (["ls", "x", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_are_one_line(capsys, argv: list[str], fragment: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert_one_line_error(err, fragment, prefix="wdsraft")
    assert "usage:" not in err and "--help` explains" in err


IN_A_PROCESS = ["nonexistent shard", "non-UTF-8 manifest", "random file as a ledger"]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [c[1:] for c in USER_ERRORS if c[0] in IN_A_PROCESS],
    ids=[c[0] for c in USER_ERRORS if c[0] in IN_A_PROCESS],
)
def test_user_errors_in_a_process_are_one_line(files, argv, fragment: str) -> None:
    process = wdsraft_process(*argv(files))
    assert process.returncode == 1
    assert_one_line_error(process.stderr, fragment)


# -- Ctrl-C --------------------------------------------------------------------------------------


def test_keyboard_interrupt_exits_130_quietly(monkeypatch, capsys) -> None:
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_ls", interrupted)
    try:
        status = cli.main(["ls", "x"])
    except KeyboardInterrupt:  # (not let through: it would end the test session)
        pytest.fail("the KeyboardInterrupt escaped main()")
    assert status == 130
    assert capsys.readouterr().err == ""


def test_ctrl_c_in_a_command_with_worker_processes_is_quiet(tmp_path: Path) -> None:
    """Ctrl-C reaches the whole process group: a worker busy with a job and an idle one end without a
    traceback each, and the command exits 130 at once (convert's workers are such a pool)."""
    started = tmp_path / "started"
    script = textwrap.dedent(
        """
        import os, signal, sys, time
        from concurrent.futures import ProcessPoolExecutor
        from wdsraft import cli

        def job(path):
            open(path, "w").close()
            time.sleep(60)

        def command(args):
            with ProcessPoolExecutor(2) as pool:  # one worker busy, one idle
                pool.submit(job, sys.argv[1])
                while not os.path.exists(sys.argv[1]):
                    time.sleep(0.01)
                os.killpg(0, signal.SIGINT)  # what Ctrl-C in a terminal sends
                time.sleep(60)
            return 0

        cli.cmd_ls = command
        sys.exit(cli.main(["ls", "unused"]))
        """
    )
    process = subprocess.run(
        [PYTHON, "-c", script, str(started)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=50,
        start_new_session=True,  # (its own process group: the SIGINT reaches nothing else)
    )
    assert process.returncode == 130 and process.stderr == "", process.stderr


# -- help texts ----------------------------------------------------------------------------------


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield (*path, name), sub, helps.get(name)
                yield from _commands(sub, (*path, name))


def test_every_command_has_a_description_and_a_help_line() -> None:
    found = {" ".join(path): (sub, help) for path, sub, help in _commands(cli.build_parser())}
    expected = [
        "index",
        "verify",
        "ls",
        "convert",
        "ledger",
        "ledger show",
        "ledger merge",
        "ledger rewind",
        "ledger export",
        "ledger compact",
    ]
    assert sorted(found) == sorted(expected)
    for name, (sub, help) in found.items():
        assert sub.description and len(sub.description) > 40, name
        assert help, name


def test_help_shows_descriptions_and_global_options() -> None:
    process = wdsraft_process("ledger", "rewind", "--help")
    shown = " ".join(process.stdout.split())  # (argparse wraps the text to the terminal's width)
    assert process.returncode == 0
    assert "without the commits after it" in shown and "--verbose" in shown and "global options" in shown


# -- an empty shard list ---------------------------------------------------------------------------


def test_an_empty_shard_list_is_a_clear_error(tmp_path: Path) -> None:
    import glob

    with pytest.raises(ValueError, match="no shards match"):
        wdsraft.WebDataset(sorted(glob.glob(str(tmp_path / "nothing-*.tar"))), shardshuffle=False)
    with pytest.raises(ValueError, match="no shards match"):
        wdsraft.SimpleShardList([])


# -- the SLURM scripts, run outside SLURM ----------------------------------------------------------

SBATCH_FILES = [REPO / "examples" / "train_array.sbatch", REPO / "scripts" / "preshuffle.sbatch"]


@pytest.mark.parametrize("path", SBATCH_FILES, ids=lambda p: p.name)
def test_sbatch_files_parse_and_document_every_variable(path: Path) -> None:
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    header = text.split("#SBATCH", 1)[0]
    body = text.split("set -euo pipefail", 1)[1]
    variables = set(re.findall(r"^([A-Z_]+)=\$\{\1:-", body, re.MULTILINE))
    variables |= set(re.findall(r'if \[ -z "\$\{([A-Z_]+):-\}" \]', body))
    assert {"PYTHON"} <= variables, variables
    for name in variables:
        assert re.search(rf"^#\s+{name}\s+\[", header, re.MULTILINE), f"{name} is not in the header of {path.name}"
    assert "#SBATCH --output=logs/" not in text  # (SLURM does not create it: the job would die without a log)


def _slurm_env(submit_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    fake_bin = submit_dir / "bin"
    fake_bin.mkdir(exist_ok=True)
    srun = fake_bin / "srun"  # drops srun's options and runs SLURM_NTASKS copies, each with its SLURM_PROCID
    srun.write_text(
        textwrap.dedent(
            """\
            #!/bin/bash
            while [[ "$1" == -* ]]; do shift; done
            pids=()
            for ((rank = 0; rank < ${SLURM_NTASKS:-1}; rank++)); do SLURM_PROCID=$rank "$@" & pids+=($!); done
            status=0
            for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
            exit $status
            """
        )
    )
    srun.chmod(0o755)
    env.update(
        PATH=f"{fake_bin}{os.pathsep}{env['PATH']}",
        PYTHONPATH=str(REPO),
        PYTHON=PYTHON,
        SLURM_SUBMIT_DIR=str(submit_dir),
        SLURM_JOB_ID="4242",
        SLURM_ARRAY_JOB_ID="4242",
        SLURM_ARRAY_TASK_ID="0",
        SLURM_ARRAY_TASK_MIN="0",
        SLURM_ARRAY_TASK_COUNT="1",
        SLURM_CPUS_PER_TASK="2",
        SLURM_MEM_PER_NODE="4096",
        SLURM_NTASKS="1",
    )
    env.update(extra)
    return env


@pytest.mark.slow
def test_sbatch_scripts_run_outside_slurm(tmp_path: Path) -> None:
    """preshuffle.sbatch with its defaults writes what train_array.sbatch reads with its defaults."""
    (tmp_path / "data").mkdir()
    corpus = REPO / "examples" / "data" / "kernel-docs-sample.jsonl.zst"
    (tmp_path / "data" / "part-000.jsonl.zst").write_bytes(corpus.read_bytes())
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "train_ledger.py").write_bytes((REPO / "examples" / "train_ledger.py").read_bytes())

    def sbatch(path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        env = _slurm_env(tmp_path, **extra)
        return subprocess.run(
            ["bash", str(path), *args], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
        )

    train, preshuffle = SBATCH_FILES
    missing = sbatch(train)
    assert missing.returncode == 1
    assert_one_line_error(missing.stderr, "no shards match", prefix="train_array.sbatch: error: ")

    converted = sbatch(preshuffle)  # (its defaults: the README's `wdsraft convert` paths)
    assert converted.returncode == 0, converted.stderr
    assert (tmp_path / "shards" / "train" / "manifest.json").exists()
    assert (tmp_path / "shards" / "train" / "train-000000.tar").exists()

    trained = sbatch(train, CHECKPOINT_EVERY="25")
    assert trained.returncode == 0, trained.stderr
    assert "WORKERS lowered from 2 to 1" in trained.stderr  # (one shard: a second worker would have none)
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert steps[:2] == ["step-00000025", "step-00000050"]

    for variable, value, fragment in [
        ("CHECKPOINT_EVERY", "often", "CHECKPOINT_EVERY must be a positive number"),
        ("PYTHON", str(tmp_path / "nope"), "no Python interpreter"),
        ("SLURM_NTASKS", "2", "1 shards for 2 ranks"),
    ]:
        refused = sbatch(train, **{variable: value})
        assert refused.returncode == 1
        assert_one_line_error(refused.stderr, fragment, prefix="train_array.sbatch: error: ")
    refused = sbatch(preshuffle, PHASE="sideways")
    assert refused.returncode == 1
    assert_one_line_error(refused.stderr, "PHASE must be", prefix="preshuffle.sbatch: error: ")
    refused = sbatch(preshuffle, str(tmp_path / "none-*.jsonl"), str(tmp_path / "out"))
    assert refused.returncode == 1
    assert_one_line_error(refused.stderr, "no input matches")


# -- wdsraft verify, and wdsraft index on damaged shards -------------------------------------------


def _dataset(directory: Path, shards: int = 3, per_shard: int = 10) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    with wdsraft.ShardWriter(str(directory / "ds-%02d.tar"), maxcount=per_shard, verbose=0) as sink:
        for n in range(shards * per_shard):
            sink.write({"__key__": f"{n:05d}", "txt": f"document {n} " * (n + 3)})
    return sorted(str(p) for p in directory.glob("ds-*.tar"))


def _flip(url: str, ordinal: int) -> int:
    where = wdsraft.ShardIndex.load(url).offsets[ordinal] + 512 + 2
    data = bytearray(Path(url).read_bytes())
    data[where] ^= 0x01
    Path(url).write_bytes(bytes(data))
    return where


def _tear(url: str, ordinal: int) -> int:
    tear = wdsraft.ShardIndex.load(url).offsets[ordinal]
    data = Path(url).read_bytes()
    Path(url).write_bytes(data[:tear] + bytes(len(data) - tear))
    return tear


def test_verify_passes_a_dataset_as_written(tmp_path: Path, capsys) -> None:
    urls = _dataset(tmp_path / "ds")
    assert cli.main(["verify", str(tmp_path / "ds"), "-q", "--workers", "2"]) == 0
    assert "verified 3 shards, 30 samples: all as recorded" in capsys.readouterr().out
    assert cli.main(["verify", *urls, "-q", "-v", "--workers", "1"]) == 0
    assert all(f"ok  {url} (10 samples)" in capsys.readouterr().out for url in urls[:1])


def test_verify_names_each_bad_shard_with_what_and_where(tmp_path: Path, capsys) -> None:
    urls = _dataset(tmp_path / "ds", shards=5)
    size = Path(urls[4]).stat().st_size
    Path(urls[4]).write_bytes(Path(urls[4]).read_bytes()[:3000])  # truncated: unreadable past 3000
    flipped = wdsraft.ShardIndex.load(urls[0]).offsets[6]
    _flip(urls[0], 6)
    tear = _tear(urls[1], 4)
    manifest_path = tmp_path / "ds" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["shardlist"][2]["nsamples"] = 11  # the manifest disagrees with shard 2 (and its index)
    manifest_path.write_text(json.dumps(manifest))
    assert cli.main(["verify", str(manifest_path), "-q", "--workers", "2"]) == 1
    out = capsys.readouterr().out
    blocks = {block.split("\n")[0]: block for block in out.split("BAD ")[1:]}
    assert set(blocks) == {urls[0], urls[1], urls[2], urls[4]}, out
    assert "truncated" in blocks[urls[4]] and f"3000 bytes, the index says {size}" in blocks[urls[4]]
    assert f"sample 6 (bytes {flipped}:" in blocks[urls[0]] and "CRC-32 differs" in blocks[urls[0]]
    assert f"at byte offset {tear}" in blocks[urls[1]] and "torn copy" in blocks[urls[1]]
    assert "10 samples, the manifest says 11" in blocks[urls[2]]
    assert "5 shards, " in out and ": 4 bad" in out


def test_verify_an_s3_prefix(tmp_path: Path, s3_bucket, capsys) -> None:
    import boto3

    urls = _dataset(tmp_path / "ds")
    client = boto3.client("s3")
    for path in (tmp_path / "ds").iterdir():
        client.put_object(Bucket=s3_bucket, Key=f"ds/{path.name}", Body=path.read_bytes())
    assert cli.main(["verify", f"s3://{s3_bucket}/ds/", "-q", "--workers", "2"]) == 0
    assert "verified 3 shards, 30 samples" in capsys.readouterr().out
    _flip(urls[1], 3)
    client.put_object(Bucket=s3_bucket, Key="ds/ds-01.tar", Body=Path(urls[1]).read_bytes())
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    manifest["shardlist"][2]["nsamples"] = 9  # the prefix's manifest is read too
    client.put_object(Bucket=s3_bucket, Key="ds/manifest.json", Body=json.dumps(manifest).encode())
    assert cli.main(["verify", f"s3://{s3_bucket}/ds/", "-q", "--workers", "2"]) == 1
    out = capsys.readouterr().out
    assert f"BAD s3://{s3_bucket}/ds/ds-01.tar" in out and "sample 3 (bytes" in out
    assert f"BAD s3://{s3_bucket}/ds/ds-02.tar" in out and "10 samples, the manifest says 9" in out


def test_verify_with_no_shards_is_a_one_line_error(tmp_path: Path) -> None:
    process = wdsraft_process("verify", str(tmp_path / "none-*.tar"), "-q")
    assert process.returncode == 1
    assert_one_line_error(process.stderr, "no shards match")


def test_index_refuses_a_shard_that_disagrees_with_its_index(tmp_path: Path, capsys) -> None:
    urls = _dataset(tmp_path / "ds")
    before = Path(urls[1] + ".idx").read_bytes()
    _flip(urls[1], 2)
    assert cli.main(["index", *urls, "-q", "--workers", "1", "--manifest", "none"]) == 1
    err = capsys.readouterr().err
    assert f"{urls[1]}: the shard disagrees with what was recorded" in err and "--force" in err
    assert "CRC-32 differs from its index's: sample 2" in err
    assert Path(urls[1] + ".idx").read_bytes() == before  # not replaced
    assert cli.main(["index", *urls, "-q", "--workers", "1", "--manifest", "none", "--force"]) == 0
    assert Path(urls[1] + ".idx").read_bytes() != before


def test_index_refuses_a_torn_shard_even_without_an_index(tmp_path: Path, capsys) -> None:
    urls = _dataset(tmp_path / "ds", per_shard=40)
    tear = _tear(urls[0], 12)
    Path(urls[0] + ".idx").unlink()
    (tmp_path / "ds" / "manifest.json").unlink()
    assert cli.main(["index", urls[0], "-q", "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert f"{urls[0]}: the archive ends here after 12 samples" in err and f"at byte offset {tear}" in err
    assert not Path(urls[0] + ".idx").exists()
    assert cli.main(["index", urls[0], "-q", "--workers", "1", "--force"]) == 0
    assert wdsraft.ShardIndex.load(urls[0]).num_samples == 12


def test_index_refuses_a_shard_that_disagrees_with_the_manifest(tmp_path: Path, capsys) -> None:
    urls = _dataset(tmp_path / "ds")
    for url in urls:
        Path(url + ".idx").unlink()
    manifest_path = tmp_path / "ds" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["shardlist"][0]["filesize"] += 512
    manifest_path.write_text(json.dumps(manifest))
    assert cli.main(["index", *urls, "-q", "--workers", "1"]) == 1
    assert "the manifest says" in capsys.readouterr().err
    assert json.loads(manifest_path.read_text()) == manifest  # not overwritten
    assert cli.main(["index", str(tmp_path / "ds"), "-q", "--workers", "1", "--force"]) == 0
