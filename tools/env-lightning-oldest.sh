#!/usr/bin/env bash
# The "oldest Lightning" lane's environment: the oldest Lightning minor polyparallel declares
# (pyproject's `lightning` extra), at that minor's latest patch, on the torch CI tests (2.13.0,
# the CPU wheel this machine serves locally), plus the project editable. The newest Lightning is
# tested by the main environment (tools/env.sh). Sourced by tools/test.sh; safe to run again (a
# stamp of the pins and the dependency files skips the install when nothing changed).
#   bash tools/env-lightning-oldest.sh          # creates .venv-lightning-oldest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LANE_VENV="${POLYPARALLEL_LIGHTNING_OLDEST_VENV:-$ROOT/.venv-lightning-oldest}"
LANE_PYTHON="${PYTHON:-python3}"
# Lightning 2.4 is the first minor with ModelParallelStrategy (FSDP2 + tensor parallelism on a
# DeviceMesh), which the adapter's sharded stages build on; 2.4.0 is the only 2.4 release.
LIGHTNING_OLDEST="2.4.0"

if [ ! -x "$LANE_VENV/bin/python" ]; then
    "$LANE_PYTHON" -m venv "$LANE_VENV"
fi
LANE_STAMP="$LANE_VENV/.polyparallel-stamp"
LANE_WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/tools/env-lightning-oldest.sh" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$LANE_STAMP" 2>/dev/null || true)" != "$LANE_WANT" ]; then
    PIP=("$LANE_VENV/bin/python" -m pip install --disable-pip-version-check -q)
    "${PIP[@]}" "torch==2.13.0"
    # Both namespaces at the oldest minor, then the project (whose extra they already satisfy).
    "${PIP[@]}" "lightning==$LIGHTNING_OLDEST" "pytorch-lightning==$LIGHTNING_OLDEST" "torch==2.13.0"
    "${PIP[@]}" -e "$ROOT[lightning,test]" "lightning==$LIGHTNING_OLDEST" "pytorch-lightning==$LIGHTNING_OLDEST" \
        "torch==2.13.0"
    echo "$LANE_WANT" > "$LANE_STAMP"
fi
