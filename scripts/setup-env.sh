#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install wdsraft into it.
#   scripts/setup-env.sh [EXTRAS]      e.g. scripts/setup-env.sh test
# constraints.txt pins torch to the CPU wheel these machines carry; elsewhere it is the
# ordinary PyPI torch of that version.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e "$spec"
