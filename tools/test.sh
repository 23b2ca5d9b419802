#!/usr/bin/env bash
# The whole test suite, from a fresh clone: creates .venv, installs, then runs the linter (ruff),
# the type checker (mypy) and pytest. All three run; the script fails if any of them failed.
#   bash tools/test.sh                 # default suite
#   bash tools/test.sh --runslow       # include tests marked slow
#   bash tools/test.sh tests/core -k topology   # any pytest arguments (lint and types still run)
#   POLYPARALLEL_SKIP_XLA=1 bash tools/test.sh   # without the XLA lane (tools/test-xla.sh)
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
else
    xla_lane=0  # a selection of tests: the XLA lane is not run
fi
python -m pytest -p no:cacheprovider "$@" || failed+=(pytest)
# The XLA lane (its own environment: torch_xla 2.9.0 needs torch 2.9.0). CI runs it; skip it
# locally with POLYPARALLEL_SKIP_XLA=1. Only with the default selection (no pytest arguments).
if [ "${POLYPARALLEL_SKIP_XLA:-0}" != "1" ] && [ "${xla_lane:-1}" = 1 ]; then
    echo "== pytest (XLA lane: tools/test-xla.sh)"
    bash "$ROOT/tools/test-xla.sh" || failed+=(pytest-xla)
fi
if [ "${#failed[@]}" -gt 0 ]; then
    echo "tools/test.sh: failed: ${failed[*]}" >&2
    exit 1
fi
