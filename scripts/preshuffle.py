#!/usr/bin/env python
"""Pre-shuffle JSONL into WebDataset shards: ``wdsraft convert`` for people who run scripts directly.

    python scripts/preshuffle.py 'data/*.jsonl.zst' --output shards/train --memory 4G --workers 8

Takes exactly the arguments of ``wdsraft convert`` (``--help`` lists them); see also
``scripts/preshuffle.sbatch`` for SLURM job arrays.
"""

from __future__ import annotations

import sys

from wdsraft.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
