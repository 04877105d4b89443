"""``wdsraft ledger show|merge|rewind|export``: inspect and maintain a ledger from the command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from wdsraft.core.errors import IndexFormatError, LedgerError
from wdsraft.core.fields import shard_of_key
from wdsraft.index.manifest import Manifest
from wdsraft.index.shard_index import ShardIndex
from wdsraft.io.storage import local_path, remove
from wdsraft.ledger.consumed import ConsumedSet
from wdsraft.ledger.identity import ShardIdentities, difference
from wdsraft.ledger.ledger import Ledger
from wdsraft.ledger.merged import merge_under, read_rank_files
from wdsraft.ledger.overview import LedgerView, view_ledger
from wdsraft.ledger.rank_file import SUFFIX, RankFile, committed_in, counted
from wdsraft.ledger.snapshot import LedgerReads, late_commits, late_marker_url, snapshot_urls

logger = logging.getLogger(__name__)


def add_ledger_commands(commands: Any, parents: Sequence[argparse.ArgumentParser] = ()) -> None:
    """Register the ``ledger`` command and its subcommands on an argparse subparsers object
    (``parents``: parsers of options every command takes, given to each)."""
    ledger = commands.add_parser(
        "ledger",
        parents=parents,
        help="inspect and maintain a ledger of consumed samples",
        description=(
            "A ledger records, per epoch, the samples a training consumed, across SLURM runs. The commands "
            "read it under a watermark: the commits a checkpoint builds on (--checkpoint FILE, or --lineage "
            "RUN=COMMIT,...); without one, the newest step that every rank of a run committed (the committed "
            "truth: commits of a checkpoint that not every rank wrote do not count); --all-commits counts every "
            "commit."
        ),
    )
    actions = ledger.add_subparsers(dest="ledger_command", required=True, metavar="ACTION")

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("path", help="the ledger directory or s3:// prefix")
        parser.add_argument("--checkpoint", help="a checkpoint (torch or JSON) holding a ledger watermark")
        parser.add_argument(
            "--lineage",
            type=_lineage_argument,
            help="the watermark as RUN=COMMIT[@STEP][,...]: with the step (`ledger show` prints each run's last "
            "step), every rank's commits up to that step count, as with --checkpoint; without it, each rank's "
            "commits up to that commit number",
        )
        parser.add_argument(
            "--all-commits",
            action="store_true",
            help="count every commit of every run, also those no committed checkpoint builds on (reads every file)",
        )
        parser.add_argument(
            "--every-file",
            action="store_true",
            help="read every rank file, not the snapshot written last plus the files it does not cover",
        )

    show = actions.add_parser(
        "show",
        parents=parents,
        help="consumed counts and fractions per epoch and shard; runs and ranks",
        description=(
            "Print the runs and ranks that wrote the ledger (which of them count under the watermark and which "
            "lie outside it, each run's last step and the watermark it resumed from), how many of the shards have "
            "a recorded dataset identity, then per epoch how many samples were consumed: with --manifest also the "
            "fraction and what remains, and the shards whose identity differs from the manifest's (exit status 1); "
            "with --shards per shard."
        ),
    )
    common(show)
    show.add_argument("--manifest", help="the dataset manifest, for fractions and what remains")
    show.add_argument("--shards", action="store_true", help="one line per shard")
    show.set_defaults(func=cmd_show)

    merge = actions.add_parser(
        "merge",
        parents=parents,
        help="write the merged consumed sets as a new one-file ledger",
        description=(
            "Merge what every commit under the watermark consumed, per epoch, into a new ledger of one run and "
            "one rank file at --output, and print its watermark (JSON). The ledger read is left as it is."
        ),
    )
    common(merge)
    merge.add_argument("--output", required=True, help="directory of the merged ledger (must not exist)")
    merge.set_defaults(func=cmd_merge)

    rewind = actions.add_parser(
        "rewind",
        parents=parents,
        help="drop the commits after a watermark (after a rewind to a checkpoint)",
        description=(
            "Rewrite each rank file of the runs in the watermark without the commits after it (for a training "
            "rewound to an older checkpoint), the watermark given with --checkpoint or --lineage (never a "
            "default: rewinding rewrites files). Files of runs outside the watermark are kept, or deleted with "
            "--prune."
        ),
    )
    common(rewind)
    rewind.add_argument("--prune", action="store_true", help="also delete the files of runs outside the lineage")
    rewind.set_defaults(func=cmd_rewind)

    export = actions.add_parser(
        "export",
        parents=parents,
        help="print the consumed positions as JSON (ordinal ranges per shard)",
        description=(
            "Print the watermark and, per epoch and shard, the consumed sample ordinals as half-open [start, end) "
            'ranges, and the documents delivered in part as {"ordinal": tokens delivered}, as JSON.'
        ),
    )
    common(export)
    export.set_defaults(func=cmd_export)

    compact = actions.add_parser(
        "compact",
        parents=parents,
        help="write a snapshot of the consumed sets under a watermark (resumes then read one object)",
        description=(
            "Merge what every commit under the watermark consumed, per epoch, into one checksummed snapshot "
            "object in PATH/snapshots/, named by the watermark. A resume under that watermark (or one that builds "
            "on it) reads the snapshot plus the rank files of the runs after it, instead of every rank file of "
            "every run. It may run beside a job: a rank that commits again at a step the snapshot covers leaves a "
            "late marker first, and readers then read that run's files on top of the snapshot. Compact a step "
            "every rank has reached (the default, or a checkpoint's watermark). A snapshot that is torn, of "
            "another ledger or lineage, or newer than the checkpoint being resumed is ignored with a warning. "
            "Under torch.distributed, checkpoint() already writes the snapshot of every checkpoint."
        ),
    )
    common(compact)
    compact.set_defaults(func=cmd_compact)


Watermark = tuple[dict[str, int], dict[str, Any]]  # (run -> last commit, run -> step of that commit)


def _lineage_argument(text: str) -> Watermark:
    lineage: dict[str, int] = {}
    steps: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        run, _, mark = item.partition("=")
        commit, at, step = mark.partition("@")
        if not run or not commit.isdigit() or (at and not step.isdigit()):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not RUN=COMMIT or RUN=COMMIT@STEP (a run id, a commit number, a training step)"
            )
        if run in lineage:
            raise argparse.ArgumentTypeError(f"run {run!r} is named twice")
        lineage[run] = int(commit)
        if at:
            steps[run] = int(step)
    if not lineage:  # (an empty watermark would count nothing, and rewind --prune would delete every file)
        raise argparse.ArgumentTypeError("no RUN=COMMIT[@STEP] given")
    return lineage, steps


def _survey(args: argparse.Namespace, every_file: bool = False) -> tuple[LedgerView, Watermark]:
    """Every run of the ledger and the watermark the command works on (given, from a checkpoint, or the
    latest): from the snapshot written last plus the files it does not cover, or every file."""
    _check_ledger_path(args.path)
    whole = every_file or args.all_commits or args.every_file
    view = view_ledger(args.path, use_snapshot=not whole, progress="reading the ledger")
    return view, _watermark(args, view)


def _consumed(
    args: argparse.Namespace, view: LedgerView, watermark: Watermark
) -> tuple[dict[int, ConsumedSet], ShardIdentities]:
    """Every epoch's consumed set under the watermark, and the identities those commits recorded: from the
    files read where every file was, else from the snapshot within the watermark plus the runs after it (as a
    resume merges them; what the survey read is not read again)."""
    identities = ShardIdentities(args.path)
    merged = merge_under(
        args.path,
        *watermark,
        identities,
        use_snapshots=view.snapshot is not None,
        progress="reading the ledger",
        known=view.files,
        reads=view.reads,
    )
    return merged.epochs, identities


def _check_ledger_path(url: str) -> None:
    """A local ledger is a directory that is there (a file or a typo would read as an empty ledger)."""
    path = local_path(url)
    if path is None:
        return
    if os.path.isfile(path):
        raise LedgerError(
            url,
            "a file, not a ledger directory: give the directory that holds the run-*/ folders of rank files "
            "(a checkpoint goes with --checkpoint)",
        )
    if not os.path.isdir(path):
        raise LedgerError(url, "no such ledger directory")


def _reader(url: str) -> Ledger:
    """The ledger at ``url``, opened to read (as no run of its own)."""
    return Ledger(url, run="inspect", rank=0, world_size=1)


def _watermark(args: argparse.Namespace, view: LedgerView) -> Watermark:
    if args.lineage is not None:
        return args.lineage
    if args.checkpoint:
        found = _watermark_from_checkpoint(args.checkpoint)
        _refuse_uncommitted(args.checkpoint, found, view, args.path)
        return found["lineage"], found.get("steps") or {}
    if args.all_commits:
        return {run: summary.last_commit() for run, summary in view.runs.items() if summary.marks}, {}
    committed, steps, how = committed_in(view.runs)
    if view.runs:
        logger.info("watermark: %s (--all-commits counts every commit)", how)
    return committed, steps


def _refuse_uncommitted(path: str, watermark: dict[str, Any], view: LedgerView, ledger: str) -> None:
    """A checkpoint whose own step not every rank of its run committed was never a committed checkpoint
    (a rank died before writing it): reading the ledger under it would count what no resume counts."""
    for run, step in (watermark.get("steps") or {}).items():
        summary = view.runs.get(run)
        if step is None or summary is None or step in summary.complete():
            continue
        # (the ranks that lack it, from the run's files: read now if the view took the run from a snapshot)
        files = [f for f in view.files if f.run == run] or list(read_rank_files(view.reads.listing.urls([run])))
        missing = sorted(f.rank for f in files if f.run == run and not any(c.get("step") == step for c in f.commits))
        raise LedgerError(
            path,
            f"its watermark names step {step} of run {run}, which not every rank committed (ranks "
            f"{missing or 'absent'} have no commit there): this checkpoint was never committed; give a committed "
            "checkpoint, or --all-commits to count every commit",
        )


def _watermark_from_checkpoint(path: str) -> dict[str, Any]:
    if path.endswith(SUFFIX):
        raise LedgerError(path, "a ledger rank file, not a checkpoint: give the ledger's directory as PATH")
    if path.endswith(".json"):
        with open(path, "rb") as stream:
            raw = stream.read()
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError as exn:  # (not UTF-8, not JSON)
            raise LedgerError(path, f"not a JSON checkpoint ({exn})") from None
    else:
        import torch

        try:
            record = torch.load(path, weights_only=True, map_location="cpu")
        except OSError:  # (a missing or unreadable file says so itself)
            raise
        except Exception as exn:  # (torch raises several kinds, with messages of many lines)
            raise LedgerError(path, f"not a checkpoint torch.load can read ({_torch_reason(exn)})") from None
    found = _find_watermark(record)
    if found is None:
        raise LedgerError(path, "no ledger watermark in this checkpoint")
    lineage, steps = found["lineage"], found.get("steps")
    if not (isinstance(lineage, dict) and all(isinstance(c, int) for c in lineage.values())) or not isinstance(
        steps, (dict, type(None))
    ):
        raise LedgerError(path, "the ledger watermark in this checkpoint is malformed (lineage: run -> commit)")
    return found


def _torch_reason(exn: Exception) -> str:
    """The line of a ``torch.load`` error that says what is wrong (its first lines are generic advice)."""
    text = str(exn).rpartition("WeightsUnpickler error:")[2]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(exn).__name__}: {lines[0]}" if lines else type(exn).__name__


def _find_watermark(record: Any) -> dict[str, Any] | None:
    if isinstance(record, dict):
        if "lineage" in record and "ledger" in record:
            return record
        for value in record.values():
            found = _find_watermark(value)
            if found is not None:
                return found
    return None


def _show_identities(identities: ShardIdentities, shards: set[str], manifest_url: str | None) -> int:
    """Print what the ledger recorded of the dataset, and where a manifest is given whether it is that
    dataset; returns the number of shards that differ."""
    known = [shard for shard in sorted(shards) if shard in identities.recorded]
    line = f"dataset: {len(known)} of {len(shards)} shards identified (sha256, samples, size of their index)"
    if identities.unrecorded_seen:
        line += "; commits of an older wdsraft record none"
    print(line)
    if not manifest_url:
        return 0
    manifest = Manifest.load(manifest_url)
    current = {
        url: {"sha256": e.sha256, "samples": e.num_samples, "size": e.size}
        for url, e in zip(manifest.urls(manifest_url), manifest.shards, strict=True)
    }
    differing = 0
    for shard in known:
        why = difference(identities.recorded[shard], current[shard]) if shard in current else None
        if why is not None:
            differing += 1
            if differing <= 5:
                print(f"  DIFFERS from {manifest_url}: {shard} ({why})")
    if differing:
        print(f"  {differing} shards differ: the ledger was written for another dataset under the same names")
    else:
        print(f"  every identified shard matches {manifest_url}")
    return differing


def _sizes(manifest_url: str | None, shards: list[str]) -> dict[str, int]:
    if manifest_url:
        manifest = Manifest.load(manifest_url)
        return dict(zip(manifest.urls(manifest_url), (e.num_samples for e in manifest.shards), strict=True))
    sizes = {}
    for shard in shards:
        with contextlib.suppress(IndexFormatError, OSError):  # unknown size: no fraction shown
            sizes[shard] = ShardIndex.load(shard).num_samples
    return sizes


def cmd_show(args: argparse.Namespace) -> int:
    view, watermark = _survey(args)
    lineage, at_steps = watermark
    if not view.runs:
        print(f"{args.path}: no ledger files")
        return 1
    if not (args.lineage or args.checkpoint or args.all_commits):
        print(f"watermark: {committed_in(view.runs)[2]} (--all-commits counts every commit)")
    print("runs:")
    for run, summary in sorted(view.runs.items()):
        commits = summary.commits()
        status = "outside the lineage (ignored)"
        if run in lineage:
            step = at_steps.get(run)
            status = f"counted up to step {step}" if step is not None else f"counted up to commit {lineage[run]}"
        last_step = summary.last_step if summary.last_step is not None else "-"
        # The watermark the run resumed from, as --lineage takes it (ranks' own commit numbers may differ).
        parents = sorted({_lineage_text(parent, parent_steps) for parent, parent_steps in summary.parents})
        started = "from " + " or ".join(parents) if parents != [""] else "fresh"
        print(
            f"  {run}: {len(summary.files)} ranks (world size {summary.world_size}), {commits} commits, "
            f"last step {last_step}, started {started}; {status}"
        )
    if view.snapshot is not None:
        print(
            f"read: {view.snapshot.url} for {len(view.trusted)} runs (as it recorded them), the files of "
            f"{len(view.runs) - len(view.trusted)} runs (--every-file reads every file)"
        )
    epochs, identities = _consumed(args, view, watermark)
    sizes: dict[str, int] = {}
    if args.manifest or args.shards:  # (without a manifest: one index read per shard, once, only when shown)
        shown = {shard_of_key(key) for consumed in epochs.values() for key in consumed.samples}
        sizes = _sizes(args.manifest, sorted(shown))
    total = sum(sizes.values()) if args.manifest else None
    # (a mixture's later passes key a shard as URL#pass=p: its identity and size are the shard URL's)
    recorded = {shard_of_key(key) for consumed in epochs.values() for key in (*consumed.samples, *consumed.tokens)}
    differing = _show_identities(identities, recorded, args.manifest)
    for epoch, consumed in epochs.items():
        count = consumed.count()
        partial = sum(len(t) for t in consumed.tokens.values())
        line = f"epoch {epoch}: {count} samples consumed in {len(consumed.samples)} shards"
        if total:
            line += f" of {total} ({count / total:.1%}); {total - count} remain"
        print(line + (f"; {partial} documents partly delivered" if partial else ""))
        if args.shards:
            for shard, bitmap in sorted(consumed.samples.items()):
                size = sizes.get(shard_of_key(shard))
                fraction = f" of {size} ({len(bitmap) / size:.0%})" if size else ""
                identity = identities.recorded.get(shard_of_key(shard))
                sha = f" [sha256 {identity['sha256'][:12]}]" if identity and identity.get("sha256") else ""
                print(f"  {shard}: {len(bitmap)}{fraction}{sha}")
    return 1 if differing else 0


def cmd_merge(args: argparse.Namespace) -> int:
    view, watermark = _survey(args)
    if _ledger_exists(args.output):
        raise LedgerError(args.output, "the output ledger exists already")
    merged = Ledger(args.output, run="merged", rank=0, world_size=1)
    epochs, identities = _consumed(args, view, watermark)
    merged.pending = epochs
    # The identities recorded then, not those of the dataset now (which may not even be reachable).
    shards = {shard for consumed in epochs.values() for shard in (*consumed.samples, *consumed.tokens)}
    merged.adopt_identities(shards, identities.recorded)
    print(json.dumps(merged.commit()))
    return 0


def _lineage_text(lineage: dict[str, int], steps: dict[str, Any]) -> str:
    marks = (
        f"{run}={commit}" + (f"@{steps[run]}" if steps.get(run) is not None else "") for run, commit in lineage.items()
    )
    return ",".join(sorted(marks))


def _ledger_exists(url: str) -> bool:
    """A local directory that is there, or an S3 prefix holding ledger files (S3 has no directories)."""
    path = local_path(url)
    if path is not None:
        return os.path.exists(path)
    return bool(_reader(url).files())


def cmd_rewind(args: argparse.Namespace) -> int:
    if args.lineage is None and not args.checkpoint and not args.all_commits:
        # (rewinding rewrites or, with --prune, deletes files: it acts only on a watermark the user names)
        raise LedgerError(args.path, "rewind needs the watermark to rewind to: --checkpoint FILE or --lineage ...")
    view, watermark = _survey(args, every_file=True)  # (it rewrites files: it reads them all)
    files = view.files
    lineage = watermark[0]
    if not lineage:
        raise LedgerError(args.path, "the watermark names no run: nothing would be kept")
    _remove_snapshots_beyond(args.path, watermark, view.reads)
    for rank_file in files:
        if rank_file.run not in lineage:
            if args.prune:
                remove(rank_file.url)
                print(f"removed {rank_file.url} (run outside the lineage)")
            else:
                print(f"kept {rank_file.url} (run outside the lineage; --prune removes it)")
            continue
        kept = [c for c in rank_file.commits if counted(c, rank_file.run, *watermark)]
        if len(kept) != len(rank_file.commits):
            dropped = len(rank_file.commits) - len(kept)
            rank_file.commits = kept
            rank_file.save()
            step = watermark[1].get(rank_file.run)
            mark = f"step {step}" if step is not None else f"commit {lineage[rank_file.run]}"
            print(f"{rank_file.url}: dropped {dropped} commits after {mark}")
    _remove_late_markers_dropped(args.path, files, lineage, args.prune)
    return 0


def _remove_late_markers_dropped(path: str, files: list[RankFile], lineage: dict[str, int], prune: bool) -> None:
    """Late markers of commits the rewind dropped (or of runs it pruned) would make every later read of
    their run's snapshots read its files again: they go."""
    kept = {(f.run, f.rank): {c["commit"] for c in f.commits} for f in files}
    for run, entries in late_commits(path).items():
        if run not in lineage and not prune:
            continue
        for rank, commit, step in entries:
            if commit not in kept.get((run, rank), set()):
                remove(late_marker_url(path, run, rank, commit, step))
                print(f"removed the late marker of commit {commit} of run {run}, rank {rank} (dropped)")


def cmd_export(args: argparse.Namespace) -> int:
    view, watermark = _survey(args)
    out: dict[str, Any] = {"lineage": watermark[0], "epochs": {}}
    for epoch, consumed in _consumed(args, view, watermark)[0].items():
        shards: dict[str, dict[str, Any]] = {}
        for shard, bitmap in sorted(consumed.samples.items()):
            shards[shard] = {"ranges": _ranges(list(bitmap))}
        for shard, tokens in consumed.tokens.items():
            if tokens:
                shards.setdefault(shard, {"ranges": []})["tokens"] = {str(o): n for o, n in sorted(tokens.items())}
        out["epochs"][str(epoch)] = shards
    print(json.dumps(out, indent=1))
    return 0


def _ranges(ordinals: list[int]) -> list[list[int]]:
    """Sorted ordinals as half-open ``[start, end)`` ranges."""
    ranges: list[list[int]] = []
    for ordinal in ordinals:
        if ranges and ranges[-1][1] == ordinal:
            ranges[-1][1] += 1
        else:
            ranges.append([ordinal, ordinal + 1])
    return ranges


def _remove_snapshots_beyond(path: str, watermark: Watermark, reads: LedgerReads) -> None:
    """Snapshots that count commits the rewind drops (or runs it prunes), or torn ones: never used under the
    rewound watermark or any that builds on it, so they go (those within it stay)."""
    urls = list(snapshot_urls(path))
    for url, parsed in zip(urls, reads.snapshots(urls), strict=True):
        if parsed is None:
            continue
        why = str(parsed) if isinstance(parsed, LedgerError) else parsed.refusal(path, *watermark)
        if why is not None:
            remove(url)
            print(f"removed the snapshot {url} ({why})")


def cmd_compact(args: argparse.Namespace) -> int:
    # (a watermark typed in needs no reading of the rank files to find it: only the runs it names are read)
    view: LedgerView | None = None
    watermark: Watermark = args.lineage
    if args.lineage is None:
        view, watermark = _survey(args)
    if not watermark[0]:
        raise LedgerError(args.path, "no watermark to compact under (no step that every rank of a run committed)")
    reader = _reader(args.path)
    # (what finding the watermark read, the snapshot, the late markers, the files, is not read again)
    url = reader.compact(*watermark, known=view.files if view else (), reads=view.reads if view else None)
    read = reader.last_read
    start = f" (from {read.snapshot.url})" if read and read.snapshot else ""
    print(f"wrote {url}: {_lineage_text(*watermark)}, {read.files_read if read else 0} rank files merged{start}")
    return 0
