"""The ``wdsraft`` command line."""

from __future__ import annotations

import argparse
import contextlib
import glob
import logging
import os
import posixpath
import signal
import sys
import tarfile
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from types import FrameType
from typing import NoReturn
from urllib.parse import urlparse

import braceexpand
from tqdm import tqdm

from wdsraft import __version__
from wdsraft.core.errors import IndexFormatError, LedgerError, StateMismatchError, TarFormatError
from wdsraft.index.manifest import MANIFEST_NAME, Manifest, ManifestEntry, manifest_for
from wdsraft.index.shard_index import ShardIndex
from wdsraft.io.s3 import list_objects
from wdsraft.io.storage import local_path
from wdsraft.ledger.cli import add_ledger_commands
from wdsraft.tar.indexer import build_index
from wdsraft.tar.reader import ShardSampleReader
from wdsraft.tar.verify import (
    ShardReport,
    compare_entry,
    compare_indexes,
    recorded_entries,
    url_key,
    verify_shard,
)

logger = logging.getLogger("wdsraft")

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")


def expand_urls(specs: Sequence[str]) -> list[str]:
    """Shard URLs from brace patterns, local globs, local directories and ``s3://`` prefixes ending in ``/``."""
    urls: list[str] = []
    for spec in specs:
        for item in braceexpand.braceexpand(spec):
            if item.startswith("s3://") and item.endswith("/"):
                urls.extend(obj.url for obj in list_objects(item) if obj.key.endswith(SHARD_SUFFIXES))
            elif urlparse(item).scheme:
                urls.append(item)
            elif os.path.isdir(item):
                urls.extend(sorted(p for p in glob.glob(os.path.join(item, "*")) if p.endswith(SHARD_SUFFIXES)))
            elif glob.has_magic(item):
                urls.extend(sorted(glob.glob(item)))
            else:
                urls.append(item)
    return urls


def _index_one(
    url: str, checksum: bool, save: bool, force: bool = False, entry: ManifestEntry | None = None
) -> tuple[str, ShardIndex]:
    index = build_index(url, checksum=checksum, strict=not force)
    if not force:  # a damaged shard must not be re-indexed as a shorter, valid-looking one
        existing = ShardIndex.beside(url)
        problems = compare_indexes(index, existing, "its index") if existing is not None else []
        problems += compare_entry(index, entry) if entry is not None else []
        if problems:
            raise IndexFormatError(
                url,
                f"the shard disagrees with what was recorded for it ({'; '.join(problems)}): damaged, or "
                "rewritten? `wdsraft verify` reports it; `wdsraft index --force` indexes it as it is now",
            )
    if save:
        index.save(url)
    return url, index


def _common_directory(urls: Sequence[str]) -> str | None:
    directories = {posixpath.dirname(url) for url in urls}
    return directories.pop() if len(directories) == 1 else None


def cmd_index(args: argparse.Namespace) -> int:
    urls = expand_urls(args.urls)
    if not urls:
        raise ValueError(f"no shards match {' '.join(args.urls)}")
    results: dict[str, ShardIndex] = {}
    failures: list[str] = []
    workers = max(1, min(args.workers, len(urls)))
    target = _manifest_target(args, urls)
    recorded = recorded_entries(target) if target is not None and not args.force else {}
    with ProcessPoolExecutor(max_workers=workers, initializer=_ignore_interrupts) as pool:
        futures = {
            pool.submit(
                _index_one, url, not args.no_checksum, not args.dry_run, args.force, recorded.get(url_key(url))
            ): url
            for url in urls
        }
        progress = tqdm(as_completed(futures), total=len(futures), unit="shard", desc="indexing", disable=args.quiet)
        try:
            for future in progress:
                url = futures[future]
                try:
                    _, index = future.result()
                except (TarFormatError, IndexFormatError, OSError, ValueError) as exn:
                    failures.append(f"{url}: {exn}")
                    logger.error("%s", exn)
                    continue
                results[url] = index
        except KeyboardInterrupt:  # the shards being indexed finish (their indexes stay valid), the rest are not begun
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    samples = sum(index.num_samples for index in results.values())
    print(f"indexed {len(results)} of {len(urls)} shards, {samples} samples")
    refused = False
    if failures and args.manifest != "none" and not args.dry_run:
        # A manifest of the good shards only would be a smaller dataset that says nothing of the others.
        print(
            f"no manifest written: {len(failures)} of {len(urls)} shards failed (mend or remove them, index again)",
            file=sys.stderr,
        )
    elif results and args.manifest != "none" and not args.dry_run:
        if target is None:
            logger.warning("shards lie in several directories: pass --manifest PATH to write a manifest")
        else:
            directory = posixpath.dirname(target)
            refused = _written_by_convert(target)
            if refused:
                print(
                    f"{target} was written by wdsraft convert (it records the inputs and the conversion): not "
                    "overwritten; pass --manifest PATH for another file, or --manifest none",
                    file=sys.stderr,
                )
            else:
                ordered = [(url, results[url]) for url in urls if url in results]
                manifest_for(directory, ordered, name=args.name).save(target)
                print(f"manifest: {target}")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures or refused else 0


def _manifest_target(args: argparse.Namespace, urls: Sequence[str]) -> str | None:
    """Where `wdsraft index` writes its manifest (None: nowhere, or no common directory for 'auto')."""
    if args.manifest == "none":
        return None
    if args.manifest != "auto":
        return str(args.manifest)
    directory = _common_directory(urls)
    return posixpath.join(directory, MANIFEST_NAME) if directory is not None else None


def _written_by_convert(manifest_url: str) -> bool:
    try:
        manifest = Manifest.load(manifest_url)
    except (IndexFormatError, OSError, UnicodeDecodeError):  # absent, or not a manifest of ours: replaced
        return False
    return manifest.inputs is not None or manifest.conversion is not None


def _verify_targets(specs: Sequence[str]) -> list[tuple[str, ManifestEntry | None]]:
    """Shards to verify, each with its manifest entry where a manifest names it: a MANIFEST.json gives its
    shards; a directory or s3 prefix gives the shards of its manifest.json, else the shards in it."""
    targets: dict[str, tuple[str, ManifestEntry | None]] = {}
    for spec in specs:
        manifest_url = None
        if spec.endswith(".json"):
            manifest_url = spec
        elif spec.endswith("/") or (local_path(spec) is not None and os.path.isdir(spec)):
            candidate = posixpath.join(spec, MANIFEST_NAME)
            manifest_url = candidate if recorded_entries(candidate) else None
        if manifest_url is not None:
            manifest = Manifest.load(manifest_url)  # (unreadable: the user's error, one line)
            for entry, url in zip(manifest.shards, manifest.urls(manifest_url), strict=True):
                targets.setdefault(url_key(url), (url, entry))
        else:
            for url in expand_urls([spec]):
                targets.setdefault(url_key(url), (url, None))
    return list(targets.values())


def cmd_verify(args: argparse.Namespace) -> int:
    targets = _verify_targets(args.targets)
    if not targets:
        raise ValueError(f"no shards match {' '.join(args.targets)}")
    reports: list[ShardReport] = []
    workers = max(1, min(args.workers, len(targets)))
    with ProcessPoolExecutor(max_workers=workers, initializer=_ignore_interrupts) as pool:
        futures = [pool.submit(verify_shard, url, entry, not args.no_checksum) for url, entry in targets]
        progress = tqdm(as_completed(futures), total=len(futures), unit="shard", desc="verifying", disable=args.quiet)
        try:
            for future in progress:
                reports.append(future.result())
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    order = {url: n for n, (url, _) in enumerate(targets)}
    reports.sort(key=lambda report: order[report.url])
    bad = [report for report in reports if not report.ok]
    for report in reports:
        for line in report.lines(verbose=args.verbose):
            print(line)
    unchecked = sum(1 for report in reports if report.notes)
    samples = sum(report.num_samples or 0 for report in reports)
    summary = f"verified {len(reports)} shards, {samples} samples: "
    print(summary + (f"{len(bad)} bad" if bad else "all as recorded"))
    if unchecked:
        print(
            f"{unchecked} shards have indexes without per-sample digests (not checked sample by sample; -v names them)"
        )
    return 1 if bad else 0


def _ignore_interrupts() -> None:
    """In worker processes: Ctrl-C interrupts the command once, in the main process (no worker tracebacks)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def cmd_ls(args: argparse.Namespace) -> int:
    offset, ordinal = 0, 0
    if args.ordinal:
        index = ShardIndex.load(args.url)
        try:
            offset, ordinal = index.offset_of(args.ordinal), args.ordinal
        except IndexError as exn:  # (an ordinal past the end is the user's, not a bug)
            raise ValueError(str(exn)) from None
    reader = ShardSampleReader(args.url, offset=offset, ordinal=ordinal)
    print("ordinal\toffset\tkey\tfields")
    for count, sample in enumerate(reader):
        if args.limit and count >= args.limit:
            break
        fields = ",".join(f"{k}:{len(v)}" for k, v in sample.items() if not k.startswith("__"))
        print(f"{sample['__ordinal__']}\t{sample['__offset__']}\t{sample['__key__']}\t{fields}")
    return 0


def _size(text: str) -> int:
    from wdsraft.convert import parse_size

    try:
        return parse_size(text)
    except ValueError as exn:
        raise argparse.ArgumentTypeError(str(exn)) from None


def cmd_convert(args: argparse.Namespace) -> int:
    from wdsraft.convert import ConvertOptions, convert, slurm_array_task

    task_index, task_count = args.task_index, args.task_count
    array_task = slurm_array_task()
    if array_task is not None:
        task_index = array_task[0] if task_index is None else task_index
        task_count = array_task[1] if task_count is None else task_count
    options = ConvertOptions(
        inputs=args.inputs,
        output=args.output,
        workdir=args.workdir,
        seed=args.seed,
        memory=args.memory,
        samples_per_shard=args.samples_per_shard,
        shard_size=args.shard_size,
        text_field=args.text_field,
        id_field=args.id_field,
        format=args.format,
        on_bad_record=args.on_bad_record,
        workers=args.workers,
        task_index=task_index or 0,
        task_count=task_count or 1,
        phase=args.phase,
        name=args.name,
        buckets=args.buckets,
        keep_workdir=args.keep_workdir,
        overwrite=args.overwrite,
        wait_timeout=args.wait_timeout,
        progress=not args.quiet,
    )
    report = convert(options)  # (a ConvertError reaches main(), which prints it)
    print(report.summary())
    return 0


CONVERT_DESCRIPTION = """\
Convert JSONL files into globally shuffled WebDataset shards, with an index beside each shard
and a manifest.json, in memory bounded by --memory whatever the corpus size.

Each record becomes one sample: the text field as KEY.txt and the other fields as KEY.json
(or the whole record as KEY.msgpack). KEY is the --id-field value, or INPUTNAME-LINE; keys
are tar-safe (characters other than letters, digits, '_' and '-' are %-escaped).

How: a two-pass external shuffle. The scatter phase gives each record a random key derived
from (seed, input name, line) and spreads the records over N bucket files in the work
directory (N from the input size and --memory); the write phase sorts each bucket by key
and writes its shards. The same inputs and --seed give byte-identical shards whatever
--workers or the number of tasks. Rerunning the same command after a crash or preemption
redoes only the unfinished inputs and buckets.

SLURM job arrays: every task of the array runs the same command; --task-index and
--task-count default from SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT. Tasks split the
inputs, wait for each other at the end of the scatter phase, split the buckets, and the
last task to finish writes the manifest. --workdir must be on a filesystem all tasks
share. Where array tasks cannot all run at once, run --phase scatter, --phase write and
--phase finalize as three dependent jobs instead (see scripts/preshuffle.sbatch).
"""

CONVERT_EPILOG = """\
bad records (invalid JSON or UTF-8, not an object, no text field, truncated or corrupt
compressed input): by default the conversion stops with an error naming the file and the
line. With --on-bad-record skip they go verbatim, with their reason, to OUTPUT/rejects.jsonl.
Blank lines are not records: they are skipped and counted. At the end, every input's
records = samples written + records rejected is checked and recorded in the manifest.

examples:
  wdsraft convert 'data/part-*.jsonl.zst' --output shards/train --memory 4G --workers 8
  wdsraft convert 's3://corpus/raw/' --output s3://corpus/shards/train --workdir /scratch/work
  wdsraft convert data/ --output out --samples-per-shard 5000 --on-bad-record skip
"""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: what is wrong, and where the help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` explains)\n")


def _global_options(parser: argparse.ArgumentParser, in_command: bool) -> None:
    """The options every command takes, before or after its name.

    A command's parser gets them with SUPPRESS defaults, so that an option given before the
    command name is not reset by the command's parser when it is not repeated after it.
    """
    group = parser.add_argument_group("global options")
    default = argparse.SUPPRESS if in_command else False
    group.add_argument("-v", "--verbose", action="store_true", default=default, help="log progress details")
    group.add_argument("-q", "--quiet", action="store_true", default=default, help="no progress bars")
    group.add_argument(
        "--debug", action="store_true", default=default, help="on an error, show the traceback, not only its message"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="wdsraft",
        description="WebDataset-compatible tar shards with sample positions, indexes and exact resume.",
        epilog="`wdsraft COMMAND --help` explains a command. Global options go before or after the command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _global_options(parser, in_command=False)
    common = _Parser(add_help=False)
    _global_options(common, in_command=True)
    parents = [common]
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    index = commands.add_parser(
        "index",
        parents=parents,
        help="build the index (.idx) of shards written by someone else, and a manifest",
        description=(
            "Read each shard once and write SHARD.idx beside it (sample count, byte offset and CRC-32 of every "
            "sample, size, sha256), then a manifest.json listing the shards. URLs may be local paths, globs, "
            "directories, brace patterns ('shard-{000000..000099}.tar'), s3://bucket/key or an s3:// prefix "
            "ending in '/'. S3 endpoints come from AWS_ENDPOINT_URL(_S3). A shard that disagrees with its "
            "existing index or manifest entry (size, sha256, samples), or whose archive ends early in a long "
            "run of zeros (a torn copy), is refused unless --force."
        ),
    )
    index.add_argument("urls", nargs="+", metavar="URL", help="shards to index")
    index.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel processes (default: cores)")
    index.add_argument(
        "--manifest",
        default="auto",
        metavar="PATH",
        help="where to write the manifest: a path, 'auto' (manifest.json beside the shards, the default) or 'none'",
    )
    index.add_argument("--name", default="dataset", help="dataset name recorded in the manifest")
    index.add_argument("--no-checksum", action="store_true", help="skip the sha256 of each shard")
    index.add_argument("--dry-run", action="store_true", help="read and report, write nothing")
    index.add_argument(
        "--force",
        action="store_true",
        help="index shards as they are now even where they disagree with their existing index or manifest "
        "entry, or end in a long run of zeros (a torn copy)",
    )
    index.set_defaults(func=cmd_index)

    verify = commands.add_parser(
        "verify",
        parents=parents,
        help="check shards against their indexes and manifest (sizes, sha256, samples, per-sample CRC-32)",
        description=(
            "Read each shard once and compare it with its SHARD.idx and its manifest entry: size, sha256, "
            "sample count, where each sample starts, and each sample's CRC-32 (indexes written by wdsraft "
            "since they have them). TARGET is a manifest (.json), a directory or s3:// prefix ending in '/' "
            "(its manifest.json if it has one, else the shards in it), or shard URLs, globs and brace patterns. "
            "Prints each bad shard with what differs and where; exits 1 if any is bad."
        ),
    )
    verify.add_argument("targets", nargs="+", metavar="TARGET", help="manifests, directories or shards")
    verify.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel processes (default: cores)")
    verify.add_argument("--no-checksum", action="store_true", help="skip the sha256 of each shard (faster)")
    verify.set_defaults(func=cmd_verify)

    ls = commands.add_parser(
        "ls",
        parents=parents,
        help="list the samples of a shard with their positions",
        description="Print ordinal, byte offset, key and field sizes of each sample of a shard.",
    )
    ls.add_argument("url", metavar="URL", help="the shard")
    ls.add_argument("--ordinal", type=int, default=0, help="start at this sample (seeks through the index)")
    ls.add_argument("--limit", type=int, default=0, help="stop after this many samples")
    ls.set_defaults(func=cmd_ls)

    from wdsraft.convert import DEFAULT_SAMPLES_PER_SHARD, FORMATS, PHASES, default_workers

    conv = commands.add_parser(
        "convert",
        parents=parents,
        help="convert JSONL (local or s3, plain/.gz/.zst) into globally shuffled shards",
        description=CONVERT_DESCRIPTION,
        epilog=CONVERT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    conv.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="JSONL files: paths, globs, brace patterns, directories, s3://bucket/key, s3:// globs or prefixes "
        "ending in '/' (.jsonl/.ndjson/.json, optionally .gz/.zst/.bz2/.xz); may be omitted for "
        "--phase write/finalize",
    )
    conv.add_argument("-o", "--output", required=True, help="output directory or s3:// prefix")
    layout = conv.add_argument_group("samples and shards")
    layout.add_argument("--text-field", default="text", help="the field holding the text (default: text)")
    layout.add_argument("--id-field", help="take sample keys from this field (default: INPUTNAME-LINE)")
    layout.add_argument(
        "--format",
        choices=FORMATS,
        default=FORMATS[0],
        help="txt+json: text as .txt, other fields as .json (default); msgpack: the whole record as .msgpack",
    )
    layout.add_argument(
        "--samples-per-shard",
        type=int,
        help=f"at most this many samples per shard (default {DEFAULT_SAMPLES_PER_SHARD:,} unless --shard-size "
        "is given)",
    )
    layout.add_argument(
        "--shard-size", type=_size, help="about this many bytes per shard, e.g. 512M (shards are balanced)"
    )
    layout.add_argument("--name", help="shard names: NAME-000000.tar... (default: the output's base name)")
    layout.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    layout.add_argument(
        "--on-bad-record",
        choices=("error", "skip"),
        default="error",
        help="error: stop at the first bad record, naming file and line (default); skip: write it to "
        "OUTPUT/rejects.jsonl and go on",
    )
    run = conv.add_argument_group("resources and work")
    run.add_argument(
        "--memory",
        type=_size,
        default="1G",
        help="memory budget for the data of this task, all workers together (default 1G; 512M, 4G...); "
        "each process adds a fixed overhead for Python and its libraries",
    )
    run.add_argument(
        "--workers", type=int, default=default_workers(), help="worker processes (default: the CPUs available)"
    )
    run.add_argument(
        "--workdir",
        help="work directory for the bucket files and progress, shared by all tasks (default: OUTPUT/.wdsraft-work "
        "for a local output, ./.wdsraft-work-HASH for s3); removed after the manifest is written",
    )
    run.add_argument("--keep-workdir", action="store_true", help="keep the work directory at the end")
    run.add_argument("--buckets", type=int, help="number of buckets (default: from the input size and --memory)")
    run.add_argument("--overwrite", action="store_true", help="replace the shards of an earlier dataset in OUTPUT")
    dist = conv.add_argument_group("SLURM arrays and phases")
    dist.add_argument("--task-index", type=int, help="this task's index (default: $SLURM_ARRAY_TASK_ID, else 0)")
    dist.add_argument("--task-count", type=int, help="number of tasks (default: $SLURM_ARRAY_TASK_COUNT, else 1)")
    dist.add_argument(
        "--phase",
        choices=PHASES,
        default="all",
        help="all (default): scatter, wait for the other tasks, write, and finalize if last; or one phase",
    )
    dist.add_argument(
        "--wait-timeout", type=float, help="seconds to wait for other tasks' scatter phase (default: no limit)"
    )
    conv.set_defaults(func=cmd_convert)
    add_ledger_commands(commands, parents)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """The errors that are the user's (bad input, missing or unreadable files): one line, no traceback."""
    from wdsraft.convert import ConvertError

    return (
        ConvertError,
        LedgerError,
        IndexFormatError,
        StateMismatchError,
        TarFormatError,
        tarfile.TarError,
        OSError,
        ValueError,
    )


def _one_line(exn: BaseException) -> str:
    if isinstance(exn, OSError) and exn.filename is not None and exn.strerror:
        return f"{exn.filename}: {exn.strerror}"  # (not "[Errno 2] No such file or directory: 'x'")
    return " ".join(str(exn).split()) or type(exn).__name__


@contextlib.contextmanager
def _interrupts() -> Iterator[list[bool]]:
    """Ctrl-C while a command runs: a KeyboardInterrupt in this process, noted in the list yielded.

    The command's worker processes (forked: they inherit the handler) end quietly instead of
    printing a KeyboardInterrupt traceback each; the conversion they were doing resumes on a
    rerun, as after any kill. The main process may then see a broken pool before the
    KeyboardInterrupt: the note tells main() that the error came from the interrupt.
    """
    seen = [False]
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) in (
        signal.SIG_IGN,
        None,
    ):
        yield seen  # (signals can only be handled in the main thread; an ignored SIGINT stays ignored)
        return
    pid = os.getpid()

    def interrupted(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != pid:
            os._exit(128 + signum)
        seen[0] = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``wdsraft`` command; returns the exit status. Errors are one line on stderr (--debug: the traceback)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    interrupted = [False]
    try:
        with _interrupts() as interrupted:
            return int(args.func(args))
    except BrokenPipeError:  # `wdsraft ls ... | head`: the reader is gone, so is whatever is still buffered
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except BaseException as exn:
        if args.debug:
            raise
        if isinstance(exn, KeyboardInterrupt) or interrupted[0]:
            return 130  # (128 + SIGINT, as a shell reports it)
        if not isinstance(exn, _user_errors()):
            raise  # (a bug: its traceback is wanted)
        print(f"wdsraft: error: {_one_line(exn)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
