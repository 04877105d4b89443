"""The ``wdsraft`` command line."""

from __future__ import annotations

import argparse
import glob
import logging
import os
import posixpath
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from urllib.parse import urlparse

import braceexpand
from tqdm import tqdm

from .errors import IndexFormatError, TarFormatError
from .gopen import s3_client
from .index import MANIFEST_NAME, ShardIndex, build_index, manifest_for
from .tariterators import ShardSampleReader

logger = logging.getLogger("wdsraft")

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")


def expand_urls(specs: Sequence[str]) -> list[str]:
    """Shard URLs from brace patterns, local globs, local directories and ``s3://`` prefixes ending in ``/``."""
    urls: list[str] = []
    for spec in specs:
        for item in braceexpand.braceexpand(spec):
            if item.startswith("s3://") and item.endswith("/"):
                urls.extend(_list_s3(item))
            elif urlparse(item).scheme:
                urls.append(item)
            elif os.path.isdir(item):
                urls.extend(sorted(p for p in glob.glob(os.path.join(item, "*")) if p.endswith(SHARD_SUFFIXES)))
            elif glob.has_magic(item):
                urls.extend(sorted(glob.glob(item)))
            else:
                urls.append(item)
    return urls


def _list_s3(prefix_url: str) -> list[str]:
    parsed = urlparse(prefix_url)
    paginator = s3_client().get_paginator("list_objects_v2")
    keys: list[str] = []
    for page in paginator.paginate(Bucket=parsed.netloc, Prefix=parsed.path.lstrip("/")):
        keys.extend(item["Key"] for item in page.get("Contents", []))
    return [f"s3://{parsed.netloc}/{key}" for key in sorted(keys) if key.endswith(SHARD_SUFFIXES)]


def _index_one(url: str, checksum: bool, save: bool) -> tuple[str, ShardIndex]:
    index = build_index(url, checksum=checksum)
    if save:
        index.save(url)
    return url, index


def _common_directory(urls: Sequence[str]) -> str | None:
    directories = {posixpath.dirname(url) for url in urls}
    return directories.pop() if len(directories) == 1 else None


def cmd_index(args: argparse.Namespace) -> int:
    urls = expand_urls(args.urls)
    if not urls:
        logger.error("no shards match %s", " ".join(args.urls))
        return 2
    results: dict[str, ShardIndex] = {}
    failures: list[str] = []
    with ProcessPoolExecutor(max_workers=max(1, min(args.workers, len(urls)))) as pool:
        futures = {pool.submit(_index_one, url, not args.no_checksum, not args.dry_run): url for url in urls}
        progress = tqdm(as_completed(futures), total=len(futures), unit="shard", desc="indexing", disable=args.quiet)
        for future in progress:
            url = futures[future]
            try:
                _, index = future.result()
            except (TarFormatError, IndexFormatError, OSError, ValueError) as exn:
                failures.append(f"{url}: {exn}")
                logger.error("%s", exn)
                continue
            results[url] = index
    samples = sum(index.num_samples for index in results.values())
    print(f"indexed {len(results)} of {len(urls)} shards, {samples} samples")
    if results and args.manifest != "none" and not args.dry_run:
        directory = _common_directory(urls) if args.manifest == "auto" else posixpath.dirname(args.manifest)
        if directory is None:
            logger.warning("shards lie in several directories: pass --manifest PATH to write a manifest")
        else:
            target = posixpath.join(directory, MANIFEST_NAME) if args.manifest == "auto" else args.manifest
            ordered = [(url, results[url]) for url in urls if url in results]
            manifest_for(directory, ordered, name=args.name).save(target)
            print(f"manifest: {target}")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


def cmd_ls(args: argparse.Namespace) -> int:
    offset, ordinal = 0, 0
    if args.ordinal:
        index = ShardIndex.load(args.url)
        offset, ordinal = index.offset_of(args.ordinal), args.ordinal
    reader = ShardSampleReader(args.url, offset=offset, ordinal=ordinal)
    print("ordinal\toffset\tkey\tfields")
    for count, sample in enumerate(reader):
        if args.limit and count >= args.limit:
            break
        fields = ",".join(f"{k}:{len(v)}" for k, v in sample.items() if not k.startswith("__"))
        print(f"{sample['__ordinal__']}\t{sample['__offset__']}\t{sample['__key__']}\t{fields}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wdsraft",
        description="WebDataset-compatible tar shards with sample positions, indexes and exact resume.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    index = commands.add_parser(
        "index",
        help="build the index (.idx) of shards written by someone else, and a manifest",
        description=(
            "Read each shard once and write SHARD.idx beside it (sample count, byte offset of every sample, "
            "size, sha256), then a manifest.json listing the shards. URLs may be local paths, globs, "
            "directories, brace patterns ('shard-{000000..000099}.tar'), s3://bucket/key or an s3:// prefix "
            "ending in '/'. S3 endpoints come from AWS_ENDPOINT_URL(_S3)."
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
    index.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    index.set_defaults(func=cmd_index)

    ls = commands.add_parser(
        "ls",
        help="list the samples of a shard with their positions",
        description="Print ordinal, byte offset, key and field sizes of each sample of a shard.",
    )
    ls.add_argument("url", metavar="URL", help="the shard")
    ls.add_argument("--ordinal", type=int, default=0, help="start at this sample (seeks through the index)")
    ls.add_argument("--limit", type=int, default=0, help="stop after this many samples")
    ls.set_defaults(func=cmd_ls)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return int(args.func(args))
    except (TarFormatError, IndexFormatError, FileNotFoundError) as exn:
        logger.error("%s", exn)
        return 1
    except BrokenPipeError:  # `wdsraft ls ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
