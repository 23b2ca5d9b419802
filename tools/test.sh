#!/usr/bin/env bash
# The whole test suite, from a fresh clone: creates .venv, installs, runs pytest.
#   bash tools/test.sh                 # default suite
#   bash tools/test.sh --runslow       # include tests marked slow
#   bash tools/test.sh tests/core -k topology   # any pytest arguments
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest -p no:cacheprovider "$@" tests examples/third_party_plugin/tests
