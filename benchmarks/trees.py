"""Before/after comparisons of wdsraft source trees (``read_path.py``, ``loader_path.py``): the shared command
line, and a measurement run in a fresh Python process whose ``PYTHONPATH`` is the tree."""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent


def parse(description: str | None) -> tuple[argparse.Namespace, dict[str, str]]:
    """``--shards``, ``--tree NAME=PATH`` (repeatable; default ``after=`` this checkout) and ``--rounds``; the
    arguments and the trees by name. Prints the shards found and the load average."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="a glob of local shards (e.g. from wdsraft convert)")
    parser.add_argument(
        "--tree", action="append", default=[], help="NAME=PATH of a wdsraft checkout (repeatable; default after=.)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    trees = dict(tree.split("=", 1) for tree in args.tree) or {"after": str(REPOSITORY)}
    print(f"shards: {args.shards} ({len(glob.glob(args.shards))} files); load average before: {load()}")
    return args, trees


def in_turn(trees: dict[str, str], number: int) -> list[str]:
    """The trees' names in round ``number``: in order, then reversed, alternately."""
    return list(trees) if number % 2 == 0 else list(trees)[::-1]


def run_child(script: str, tree: str, *arguments: str) -> str:
    """What ``script --child ARGUMENTS`` prints, run with ``tree``'s wdsraft."""
    environment = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    command = [sys.executable, script, "--child", *arguments]
    return subprocess.run(command, env=environment, check=True, capture_output=True, text=True).stdout


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]
