"""``python -m wdsraft``: the ``wdsraft`` command."""

from __future__ import annotations

import sys

from wdsraft.cli import main

if __name__ == "__main__":
    sys.exit(main())
