#!/usr/bin/env bash
# The main job, from a fresh clone: the same Strategy trained in every installed framework on
# 2 CPU processes, results side by side. Extra arguments go to `polyparallel demo`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec timeout -k 10 1200 polyparallel demo --nprocs 2 "$@"
