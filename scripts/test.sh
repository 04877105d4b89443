#!/usr/bin/env bash
# One command from a fresh clone: install the test dependencies, lint, type-check, run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh test
export PATH="$PWD/.venv/bin:$PATH"
ruff check wdsraft tests benchmarks examples scripts
mypy
set +e
python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then  # pytest: no tests collected
  echo "pytest collected no tests" >&2
  exit 1
fi
if [ "$status" -ne 0 ]; then
  exit "$status"
fi
# The whole suite passed: check that the tests still catch a curated list of deliberate bugs
# (docs/development.md). A run with pytest arguments (a subset of the tests) stops here.
if [ "$#" -eq 0 ]; then
  python scripts/mutation_canary.py --jobs 2
fi
