#!/usr/bin/env bash
# One command from a fresh clone: install wdsraft and run the main job on the bundled corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/python examples/quickstart.py "$@"
