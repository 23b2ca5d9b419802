#!/usr/bin/env bash
# The whole test suite, from a fresh clone: creates .venv, installs, then runs the linter (ruff),
# the type checker (mypy) and pytest. All three run; the script fails if any of them failed.
#   bash tools/test.sh                 # default suite
#   bash tools/test.sh --runslow       # include tests marked slow
#   bash tools/test.sh tests/core -k topology   # any pytest arguments (lint and types still run)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/env.sh" || exit 1
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
failed=()
echo "== ruff check"
ruff check . || failed+=(ruff)
echo "== mypy"
mypy || failed+=(mypy)
echo "== pytest"
if [ "$#" -eq 0 ] || [[ "$1" == -* ]]; then
    set -- "$@" tests examples/third_party_plugin/tests
fi
python -m pytest -p no:cacheprovider "$@" || failed+=(pytest)
if [ "${#failed[@]}" -gt 0 ]; then
    echo "tools/test.sh: failed: ${failed[*]}" >&2
    exit 1
fi
