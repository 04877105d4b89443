#!/usr/bin/env python3
"""Mutation canary: plant deliberate bugs in wdsraft, one at a time, and check that the tests catch each.

Every mutation below is a small edit (an exact old text, found exactly once under wdsraft/, and its
replacement) that changes what users get, with the targeted tests that must catch it. For each one,
the script copies the repository's package, tests and what they need into a temporary directory,
applies the edit there and runs ``python -m pytest -x`` on the targets with that copy as the working
directory (a small pytest plugin checks that wdsraft is imported from the copy). The targets are also
run once, unmutated, first: a canary over failing tests proves nothing.

"Caught" means pytest exited with 1 and named a failed test. Anything else is not: the tests passed
(the mutation survived), they could not be collected, only a fixture errored, the mutated code did
not even import, or the run timed out. The script exits 1 unless every mutation is caught.

Progress goes to stderr, the final table to stdout.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "wdsraft"
# What a copy holds: the package, the tests, and what the tests read (the bundled corpus, the example
# and SLURM scripts, pytest's configuration, the package metadata).
COPIED = ("wdsraft", "tests", "examples", "scripts", "pyproject.toml", "setup.cfg", "README.md", "constraints.txt")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache", "*.egg-info")
PLUGIN = "_mutation_canary_plugin"
IMPORTED_FROM = "_mutation_canary_imported.txt"
ROOT_VARIABLE = "MUTATION_CANARY_ROOT"

# Failures that mean the mutated code is broken rather than wrong: they prove nothing about the tests.
BROKEN_CODE = re.compile(r"^(NameError|ImportError|ModuleNotFoundError|SyntaxError|IndentationError|TabError)\b")


@dataclasses.dataclass(frozen=True)
class Mutation:
    id: str
    what: str  # what the bug does to a user, in one line
    old: str  # exact text, found exactly once in the whole package
    new: str
    tests: tuple[str, ...]  # pytest node ids or files, the one expected to catch it first


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "tar-large-member-checksum",
        "a member larger than the read block is trusted without its header checksum: a flipped bit in its "
        "name hands out a sample under a wrong key",
        "            if not header_checksum_ok(header):\n"
        '                raise TarFormatError(url, offset, "bad header checksum (corrupt or not a tar archive)")\n'
        "            # (`size`: this header's, from the loop above, which stopped at it)\n",
        "            # (`size`: this header's, from the loop above, which stopped at it)\n",
        ("tests/tar/test_integrity_proofs.py",),
    ),
    Mutation(
        "ledger-tokens-last-wins",
        "merging ledger commits keeps the last token count of a cut document, not the largest: an elastic "
        "resume delivers its tokens again",
        "per_shard[ordinal] = max(per_shard.get(ordinal, 0), token_end)",
        "per_shard[ordinal] = token_end",
        ("tests/ledger/test_ledger_tokens.py",),
    ),
    Mutation(
        "local-seek-reads",
        "opening a local shard at an offset reads and discards everything before it instead of seeking: "
        "resuming deep in a shard costs the whole prefix",
        "            raw.seek(offset)\n            return raw\n",
        "            raw.seek(0)\n            discard(raw, offset, url)\n            return raw\n",
        ("tests/pipeline/test_resume_cost.py::test_starting_at_an_offset_reads_the_same_whatever_the_offset",),
    ),
    Mutation(
        "elastic-ignores-index",
        "an elastic resume ignores the shard index and reads every shard whole, dropping consumed samples "
        "only after reading them",
        "if index is None or index.compression is not None:",
        "if True:  # the index is not used",
        (
            "tests/pipeline/test_resume_cost.py::test_an_elastic_resume_opens_no_consumed_shard_and_reads_nothing_consumed",
        ),
    ),
    Mutation(
        "tar-chain-start-offset",
        "a sample whose name needs a PAX or GNU long-name header is placed at its real header, after the "
        "extended one: seeking or resuming there reads it under its truncated ustar name",
        "chain_start = self._chain_start if self._chain_start is not None else offset",
        "chain_start = offset",
        ("tests/tar/test_seek.py::test_seek_to_every_sample_local",),
    ),
    Mutation(
        "tar-gnu-longname-nul",
        "a GNU long name keeps its terminating NUL: samples of shards written in GNU format get keys "
        "webdataset does not give them",
        "self._pending_name = _decode_name(_cstring(data))",
        "self._pending_name = _decode_name(data)",
        (
            "tests/tar/test_compat.py::test_explicit_formats_read_by_both[GNU_FORMAT]",
            "tests/tar/test_compat.py::test_archives_made_by_gnu_tar[gnu]",
        ),
    ),
    Mutation(
        "index-end-entry",
        "a built index ends at the bytes read so far instead of where the last sample ends: the last "
        "sample's span is wrong and the index disagrees with the writer's",
        "end = reader.next_offset",
        "end = hashing.count",
        ("tests/index/test_index.py::test_writer_index_equals_built_index",),
    ),
    Mutation(
        "writer-index-merged-keys",
        "the writer's index starts a new sample at every write, even where readers merge it into the "
        "previous one (same key, keys with dots): sample counts and seeks are off",
        "if reader_key is None or reader_key == self._last_key:",
        "if reader_key is None:",
        ("tests/index/test_index.py::test_writer_index_follows_what_readers_see",),
    ),
    Mutation(
        "shuffle-stale-addresses",
        "the shuffle buffer's saved addresses are not kept in step with its items: a resumed shuffle "
        "hands out other samples than the uninterrupted run",
        "buf[k], addresses[k] = buf[-1], addresses[-1]",
        "buf[k] = buf[-1]",
        ("tests/pipeline/test_pipeline.py::test_restore_at_every_step",),
    ),
    Mutation(
        "shuffle-rng-not-restored",
        "a resumed shuffle restarts its RNG from the seed instead of the saved RNG state: the order after "
        "a resume differs",
        '            rng = unpack_rng(state["rng"])\n            if self.rng is not None:',
        "            rng = self._epoch_rng(ctx)\n            if self.rng is not None:",
        ("tests/pipeline/test_pipeline.py::test_restore_at_every_step",),
    ),
    Mutation(
        "batched-clears-after-yield",
        "batched forgets a full batch only after it was handed out: a state taken right after a batch "
        "saves it as a partial batch, and a resume delivers its samples again",
        "                batch.clear()\n"
        "                addresses.clear()\n"
        "                batch.append(sample)\n"
        "                addresses.append(address)\n"
        "                upstream = ctx.hand_out(None)  # a batch has many sources: stages after it cannot address it\n"
        "                yield out\n",
        "                upstream = ctx.hand_out(None)  # a batch has many sources: stages after it cannot address it\n"
        "                yield out\n"
        "                batch.clear()\n"
        "                addresses.clear()\n"
        "                batch.append(sample)\n"
        "                addresses.append(address)\n",
        ("tests/pipeline/test_pipeline.py::test_restore_at_every_step",),
    ),
    Mutation(
        "unbatched-next-repeats",
        "unbatched saves the position of the item it just handed out, not the next: a resume in the "
        "middle of a batch delivers that item twice",
        "self._next = position + 1",
        "self._next = position",
        (
            "tests/pipeline/test_readme_claims.py::test_unbatched_after_a_webloader_resumes_in_the_middle_of_a_batch",
            "tests/pipeline/test_readme_claims.py::test_unbatched_between_inner_batches_saves_and_resumes",
        ),
    ),
    Mutation(
        "ledger-merge-keeps-partial",
        "merging ledger commits keeps a document as partly delivered after a later commit delivered it "
        "whole: `wdsraft ledger show` reports it as partly delivered",
        "for touched in other.samples.keys() | other.tokens.keys():",
        "for touched in other.tokens.keys():",
        ("tests/ledger/test_ledger.py::test_ledger_cli_counts_a_document_finished_later_as_whole_and_checks_lineages",),
    ),
    Mutation(
        "ledger-merge-replaces",
        "merging ledger commits replaces a shard's consumed samples instead of adding to them: an elastic "
        "resume delivers samples consumed in earlier commits again",
        "        for shard, ordinals in other.samples.items():\n"
        "            self.samples.setdefault(shard, BitMap()).update(ordinals)\n",
        "        for shard, ordinals in other.samples.items():\n            self.samples[shard] = BitMap(ordinals)\n",
        ("tests/ledger/test_ledger.py::test_commits_lineage_and_rewind",),
    ),
    Mutation(
        "ledger-counted-by-commit",
        "other ranks' commits count by commit number, not by step: a rank that committed twice at one step "
        "makes a checkpoint count samples another rank consumed later, which are then lost",
        '    if step is not None and commit.get("step") is not None:\n        return bool(commit["step"] <= step)\n',
        "",
        ("tests/ledger/test_ledger.py::test_watermarks_count_other_ranks_by_step_not_by_commit_number",),
    ),
    Mutation(
        "ledger-watermark-no-step",
        "a watermark leaves out the step of the run's own last commit: its checkpoints count other ranks' "
        "commits by number",
        "lineage[self.run], steps[self.run] = self.commit_number, self.last_step",
        "lineage[self.run] = self.commit_number",
        ("tests/ledger/test_ledger.py::test_watermarks_count_other_ranks_by_step_not_by_commit_number",),
    ),
    Mutation(
        "convert-line-not-mixed",
        "the converter's shuffle key ignores the line number within a read batch: lines read together keep "
        "their input order in the output",
        "np.arange(first_line, first_line + count, dtype=np.uint64)",
        "np.full(count, first_line, dtype=np.uint64)",
        ("tests/convert/test_convert.py::test_shuffle_spreads_each_input_over_shards_and_positions",),
    ),
    Mutation(
        "convert-input-not-mixed",
        "the converter's shuffle key ignores the input's name: inputs of equal length are shuffled in "
        "lockstep, line n of each landing side by side",
        'f"{seed}\\0{input_name}".encode()',
        'f"{seed}".encode()',
        ("tests/convert/test_convert.py::test_shuffle_spreads_each_input_over_shards_and_positions",),
    ),
    Mutation(
        "concat-chunk-leftover-span",
        "concat_chunk remembers the leftover of a cut document from the start of its piece: a resume "
        "re-reads tokens already delivered",
        "rest = [(tokens[count:], address, start + count, end, total, position), *pieces[i + 1 :]]",
        "rest = [(tokens[count:], address, start, end, total, position), *pieces[i + 1 :]]",
        ("tests/llm/test_llm.py::test_restore_at_every_step",),
    ),
    Mutation(
        "bestfit-remainder-span",
        "pack_bestfit records the remainder of a long document as starting at the document's start: its "
        "provenance is wrong and a resume re-reads the wrong tokens",
        "self._held.append((tokens[full * n :], address, base + full * n, end, end, position))",
        "self._held.append((tokens[full * n :], address, base, end, end, position))",
        (
            "tests/llm/test_llm.py::test_no_token_lost_or_duplicated[pack_bestfit]",
            "tests/llm/test_llm.py::test_restore_at_every_step[pack_bestfit]",
        ),
    ),
    Mutation(
        "token-start-not-carried",
        "a document continued after an elastic resume counts its tokens from 0 again: the ledger records "
        "the wrong token range and the next resume repeats tokens",
        "return (tokens[start:], start) if start else (tokens, 0)",
        "return (tokens[start:], 0) if start else (tokens, 0)",
        ("tests/ledger/test_ledger_tokens.py",),
    ),
    Mutation(
        "state-mismatch-unnamed",
        "loading a state into a changed pipeline says only that the configuration differs, not which field",
        'detail = "; ".join(changed[:6]) or "configuration differs"',
        'detail = "configuration differs"',
        ("tests/pipeline/test_readme_claims.py::test_a_state_loaded_into_another_configuration_names_what_differs",),
    ),
    Mutation(
        "index-count-ignored",
        "a reader with an index no longer compares the sample count at the shard's end: a copy whose tail "
        "was zero-filled at a sample boundary silently yields fewer samples",
        "short = not closed or ordinal + 1 < count",
        "short = not closed",
        ("tests/tar/test_shard_integrity.py",),
    ),
    Mutation(
        "remote-reopen-from-zero",
        "a remote read that failed part-way reopens at byte 0 instead of the byte reached: the shard's "
        "first bytes are delivered twice",
        "opened = opener(self._pos, self._etag)",
        "opened = opener(0, self._etag)",
        ("tests/io/test_remote_reads.py::test_a_fault_costs_a_retry_not_a_byte",),
    ),
    Mutation(
        "ledger-snapshot-newer-trusted",
        "a ledger snapshot newer than the checkpoint being resumed (after a rewind) is trusted: samples "
        "consumed after the checkpoint are skipped, never delivered",
        "if value > want_value:",
        "if value > want_value and False:",
        ("tests/ledger/test_ledger_scale.py",),
    ),
)


# -- the plugin that proves the copy is what the tests import --------------------------------------

PLUGIN_SOURCE = f'''"""Written by scripts/mutation_canary.py: wdsraft must be imported from this copy."""
import os

import pytest


def pytest_configure(config):
    root = os.path.realpath(os.environ["{ROOT_VARIABLE}"])
    try:
        import {PACKAGE}
    except BaseException as exn:  # a mutation that breaks the import proves nothing
        raise pytest.UsageError(f"mutation canary: cannot import {PACKAGE}: {{type(exn).__name__}}: {{exn}}") from None
    path = os.path.realpath({PACKAGE}.__file__)
    with open(os.path.join(root, "{IMPORTED_FROM}"), "w") as out:
        out.write(path)
    if not path.startswith(root + os.sep):
        raise pytest.UsageError(f"mutation canary: {PACKAGE} imported from {{path}}, not from the copy in {{root}}")
'''


# -- finding and applying mutations ----------------------------------------------------------------


class CanaryError(Exception):
    """A mistake in the canary itself (a mutation that cannot be applied as written)."""


def locate(mutation: Mutation, root: Path) -> Path:
    """The file under ``root/wdsraft`` holding the mutation's old text (relative to ``root``)."""
    hits = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        count = path.read_text(encoding="utf-8").count(mutation.old)
        hits += [path.relative_to(root)] * count
    if len(hits) != 1:
        counts = collections.Counter(str(p) for p in hits)
        where = ", ".join(f"{p} x{n}" if n > 1 else p for p, n in list(counts.items())[:4]) or "nowhere"
        where += ", ..." if len(counts) > 4 else ""
        raise CanaryError(f"old text found {len(hits)} times under {PACKAGE}/ ({where}), not exactly once")
    return hits[0]


def mutated_source(mutation: Mutation, path: Path) -> str:
    source = path.read_text(encoding="utf-8")
    changed = source.replace(mutation.old, mutation.new, 1)
    if changed == source:
        raise CanaryError("the mutation changes nothing")
    try:
        compile(changed, str(path), "exec")
    except SyntaxError as exn:
        raise CanaryError(f"the mutated file does not compile: {exn}") from None
    return changed


def make_copy(destination: Path) -> Path:
    destination.mkdir(parents=True)
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, destination / name, ignore=IGNORED, symlinks=True)
        elif source.exists():
            shutil.copy2(source, destination / name)
    (destination / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE, encoding="utf-8")
    return destination


# -- running pytest --------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    name: str  # a mutation id, or "baseline N"
    verdict: str
    caught_by: list[str]
    seconds: float
    file: str = ""
    detail: str = ""  # why it is not caught, or the failure's message
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict in ("caught", "passed")


_running: dict[int, subprocess.Popen] = {}
_running_lock = threading.Lock()
_stopping = threading.Event()  # set on Ctrl-C: a pytest started after that is ended at once


def run_pytest(copy: Path, targets: Sequence[str], timeout: float) -> tuple[int | None, str, float]:
    """Run pytest on ``targets`` in ``copy``; returns (exit code or None on timeout, output, seconds)."""
    env = dict(os.environ)
    env[ROOT_VARIABLE] = str(copy)
    # Subprocesses the tests start (spawned workers, CLI runs) must import the copy too, not an installed wdsraft.
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["COLUMNS"] = "400"  # (pytest cuts the failure message off its short summary line at the terminal width)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        PLUGIN,
        "-rfE",
        f"--basetemp={copy / '.pytest-tmp'}",  # (parallel runs must not clean up each other's tmp_path)
        *targets,
    ]
    start = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=copy,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,  # its own process group: a timeout ends the tests' children too
    )
    with _running_lock:
        _running[process.pid] = process
        if _stopping.is_set():
            _kill_group(process)
    try:
        output, _ = process.communicate(timeout=timeout)
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        _kill_group(process)
        output, _ = process.communicate()
        code = None
    finally:
        with _running_lock:
            _running.pop(process.pid, None)
    return code, output, time.monotonic() - start


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # the group this script created for that pytest


SUMMARY = re.compile(r"^(FAILED|ERROR) (.+?)(?: - (.*))?$")


def failures(output: str) -> tuple[list[tuple[str, str]], list[str]]:
    """From pytest's short test summary: (failed node id, message) pairs, and errored node ids."""
    failed, errored = [], []
    for line in output.splitlines():
        match = SUMMARY.match(line)
        if match is None:
            continue
        if match.group(1) == "FAILED":
            failed.append((match.group(2), match.group(3) or ""))
        else:
            errored.append(match.group(2))
    return failed, errored


PYTEST_EXITS = {2: "interrupted or collection error", 3: "internal error", 4: "usage error", 5: "no tests collected"}


def judge(copy: Path, code: int | None, output: str, timeout: float, mutated: bool) -> tuple[str, list[str], str]:
    """(verdict, catching tests, detail) for one pytest run."""
    imported = copy / IMPORTED_FROM
    if code is None:
        return "timeout", [], f"no result within {timeout:.0f} s"
    if not imported.exists() or not imported.read_text().startswith(str(copy.resolve())):
        reason = _last_line(output, "mutation canary:") or "the check of wdsraft's location did not run"
        return "not-imported", [], reason
    failed, errored = failures(output)
    if code == 0:
        return ("survived" if mutated else "passed"), [], ""
    if code == 1 and failed:
        broken = [message for _, message in failed if BROKEN_CODE.match(message)]
        if broken:
            return "broken-code", [node for node, _ in failed], broken[0]
        return ("caught" if mutated else "failed"), [node for node, _ in failed], failed[0][1]
    if code == 1:
        return "errored", errored, "no test failed: only errors in fixtures or setup " + ", ".join(errored)
    return f"pytest-exit-{code}", [], PYTEST_EXITS.get(code, "unexpected exit code") + _collection_hint(output)


def _last_line(output: str, containing: str) -> str:
    lines = [line.strip() for line in output.splitlines() if containing in line]
    return lines[-1] if lines else ""


def _collection_hint(output: str) -> str:
    hint = _last_line(output, "ERROR") or _last_line(output, "Error")
    return f": {hint}" if hint else ""


# -- the tasks -------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[canary {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_baseline(name: str, targets: list[str], workdir: Path, timeout: float, verbose: bool) -> Outcome:
    copy = make_copy(workdir / name.replace(" ", "-"))
    log(f"{name}: {len(targets)} targets, unmutated")
    code, output, seconds = run_pytest(copy, targets, timeout)
    verdict, caught_by, detail = judge(copy, code, output, timeout, mutated=False)
    outcome = Outcome(name, verdict, caught_by, seconds, detail=detail, output=output)
    _report(outcome, verbose)
    return outcome


def run_mutation(mutation: Mutation, workdir: Path, timeout: float, verbose: bool) -> Outcome:
    start = time.monotonic()
    try:
        relative = locate(mutation, REPO)
        changed = mutated_source(mutation, REPO / relative)
    except CanaryError as exn:
        outcome = Outcome(mutation.id, "canary-error", [], time.monotonic() - start, detail=str(exn))
        _report(outcome, verbose)
        return outcome
    copy = make_copy(workdir / mutation.id)
    (copy / relative).write_text(changed, encoding="utf-8")
    log(f"{mutation.id}: mutated {relative}, running {' '.join(mutation.tests)}")
    code, output, seconds = run_pytest(copy, mutation.tests, timeout)
    verdict, caught_by, detail = judge(copy, code, output, timeout, mutated=True)
    outcome = Outcome(mutation.id, verdict, caught_by, seconds, str(relative), detail, output)
    _report(outcome, verbose)
    return outcome


def _report(outcome: Outcome, verbose: bool) -> None:
    if _stopping.is_set():
        return  # (interrupted: runs ended by Ctrl-C say nothing about the tests)
    line = f"{outcome.name}: {outcome.verdict} ({outcome.seconds:.1f} s)"
    if outcome.caught_by:
        line += f" by {', '.join(outcome.caught_by)}"
    if outcome.detail:
        line += f": {outcome.detail[:300]}"
    log(line)
    if outcome.output and (verbose or not outcome.ok):
        tail = "\n".join(_shortened(line) for line in outcome.output.rstrip().splitlines()[-40:])
        print(tail, file=sys.stderr, flush=True)


def _shortened(line: str) -> str:
    if set(line) <= set("_=!- "):  # pytest's rules, drawn as wide as the COLUMNS it was given
        return line[:100]
    return line if len(line) <= 240 else line[:240] + " ..."


def baseline_groups(mutations: Sequence[Mutation], jobs: int) -> list[list[str]]:
    """The union of the mutations' targets (each test once), split by file into at most ``jobs`` runs."""
    files = {target.split("::")[0] for m in mutations for target in m.tests if "::" not in target}
    by_file: dict[str, list[str]] = {}
    for mutation in mutations:
        for target in mutation.tests:
            file = target.split("::")[0]
            if file in files and target != file:
                continue  # the whole file runs anyway
            nodes = by_file.setdefault(file, [])
            if target not in nodes:
                nodes.append(target)
    groups: list[list[str]] = [[] for _ in range(max(1, min(jobs, len(by_file))))]
    for file in sorted(by_file, key=lambda f: -len(by_file[f])):
        min(groups, key=len).extend(by_file[file])
    return [group for group in groups if group]


# -- the table -------------------------------------------------------------------------------------


def table(mutations: Sequence[Mutation], outcomes: dict[str, Outcome]) -> str:
    rows = [("ID", "VERDICT", "SECS", "FILE", "CAUGHT BY")]
    notes = {}
    for mutation in mutations:
        outcome = outcomes.get(mutation.id)
        if outcome is None:
            rows.append((mutation.id, "not-run", "-", "", ""))
            continue
        rows.append(
            (mutation.id, outcome.verdict, f"{outcome.seconds:.1f}", outcome.file, ", ".join(outcome.caught_by) or "-")
        )
        notes[mutation.id] = mutation.what if outcome.verdict == "caught" else f"{mutation.what} [{outcome.detail}]"
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4])
        if row[0] in notes:
            lines.append(" " * (widths[0] + 2) + notes[row[0]])
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Plant each of a curated list of deliberate bugs in a temporary copy of wdsraft, run the targeted "
            "tests against it, and fail unless every bug is caught (a targeted test fails). The targeted tests "
            "first run once unmutated: they must pass. Progress goes to stderr; the table to stdout."
        ),
        epilog=(
            "Verdicts: caught (pytest exit 1, a test failed); survived (the tests passed: a gap in the tests); "
            "errored (only fixture errors), broken-code (the failure is a NameError/ImportError...), "
            "not-imported (wdsraft did not come from the copy), pytest-exit-N (collection, usage...), timeout, "
            "canary-error (the mutation's old text is not found exactly once under wdsraft/, or the edit does not "
            "compile). Every verdict but caught fails the run."
        ),
    )
    parser.add_argument(
        "--list", action="store_true", help="list the mutations, the file each applies to and their tests, then exit"
    )
    parser.add_argument("--only", metavar="ID[,ID...]", help="run only these mutations (comma-separated ids)")
    parser.add_argument("--jobs", type=int, default=2, help="pytest processes at once (default: %(default)s)")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds a pytest run may take (default: %(default)s)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies (their path is logged)")
    parser.add_argument("--verbose", action="store_true", help="log the tail of every pytest run, not just failures")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    return args


def select(only: str | None) -> list[Mutation]:
    ids = [m.id for m in MUTATIONS]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise SystemExit(f"mutation canary: duplicate mutation ids {sorted(duplicates)}")
    if only is None:
        return list(MUTATIONS)
    wanted = [part.strip() for part in only.split(",") if part.strip()]
    unknown = [i for i in wanted if i not in ids]
    if unknown:
        raise SystemExit(f"mutation canary: unknown mutation ids {unknown} (see --list)")
    return [m for m in MUTATIONS if m.id in wanted]


def list_mutations(mutations: Sequence[Mutation]) -> int:
    """Print the mutations; 1 if one of them cannot be applied as written."""
    status = 0
    for mutation in mutations:
        try:
            where = str(locate(mutation, REPO))
        except CanaryError as exn:
            where, status = f"CANARY ERROR: {exn}", 1
        print(f"{mutation.id}\n    {mutation.what}\n    in: {where}\n    tests: {' '.join(mutation.tests)}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mutations = select(args.only)
    if args.list:
        return list_mutations(mutations)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="mutation-canary-"))
    log(f"{len(mutations)} mutations, {args.jobs} at a time, copies under {workdir}")
    outcomes: dict[str, Outcome] = {}
    baselines: list[Outcome] = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs)
    try:
        # The unmutated runs go first in the queue; a failing one cancels the mutations not yet started.
        baseline_futures = [
            pool.submit(run_baseline, f"baseline {n + 1}", group, workdir, args.timeout, args.verbose)
            for n, group in enumerate(baseline_groups(mutations, args.jobs))
        ]
        mutation_futures = {pool.submit(run_mutation, m, workdir, args.timeout, args.verbose): m for m in mutations}
        for future in concurrent.futures.as_completed(baseline_futures):
            baselines.append(future.result())
            if not baselines[-1].ok:
                log(f"{baselines[-1].name} did not pass: the mutations' verdicts would mean nothing; stopping")
                for pending in mutation_futures:
                    pending.cancel()
        for future, mutation in mutation_futures.items():
            if not future.cancelled():
                outcomes[mutation.id] = future.result()
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        with _running_lock:
            _stopping.set()
            for process in list(_running.values()):
                _kill_group(process)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if args.keep:
            log(f"copies kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.monotonic() - started

    print(table(mutations, outcomes))
    failed_baselines = [b for b in baselines if not b.ok]
    not_caught = [m.id for m in mutations if m.id not in outcomes or outcomes[m.id].verdict != "caught"]
    print()
    for baseline in failed_baselines:
        print(f"{baseline.name}: the unmutated tests did not pass ({baseline.verdict}: {baseline.detail})")
    caught = len(mutations) - len(not_caught)
    print(f"{caught} of {len(mutations)} mutations caught in {elapsed:.0f} s (--jobs {args.jobs})")
    if not_caught:
        print(f"not caught: {', '.join(not_caught)}")
    return 1 if failed_baselines or not_caught else 0


if __name__ == "__main__":
    sys.exit(main())
