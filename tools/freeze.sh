#!/usr/bin/env bash
# Write tools/constraints.txt from an environment the whole suite passed in: the exact versions
# tools/env.sh then installs on a fresh clone (so it gets what CI tested).
#   POLYPARALLEL_VENV=.venv-newest POLYPARALLEL_CONSTRAINTS= bash tools/test.sh   # try the newest releases
#   POLYPARALLEL_VENV=.venv-newest bash tools/freeze.sh                          # then pin them
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${POLYPARALLEL_VENV:-$ROOT/.venv}"
OUT="$ROOT/tools/constraints.txt"
{
    # torch: the local CPU wheel's "+cpu" label is dropped (== matches it, and other builds of the same release).
    # torchvision: fastai requires it; env.sh removes it again when it cannot load against this torch.
    "$VENV/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check 2>/dev/null \
        | grep -v '^#' | sed -E 's/^(torch==[^+]+)\+.*/\1/' | grep -viE '^(polyparallel|polyparallel-records)=='
    if ! "$VENV/bin/python" -m pip show -q torchvision >/dev/null 2>&1; then
        tv=$("$VENV/bin/python" -m pip install --dry-run -q --disable-pip-version-check --report - \
                 "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')" torchvision 2>/dev/null \
             | "$VENV/bin/python" -c 'import json,sys; print(next(i["metadata"]["version"] for i in json.load(sys.stdin)["install"] if i["metadata"]["name"] == "torchvision"))')
        echo "torchvision==$tv"
    fi
} | LC_ALL=C sort -f -u -t= -k1,1 > "$OUT.pins"
{
    echo "# The versions the test suite passed with (tools/freeze.sh wrote this; tools/env.sh installs from it)."
    echo "# Regenerate after testing newer releases: see CONTRIBUTING.md, \"Versions\"."
    cat "$OUT.pins"
} > "$OUT.tmp"
rm -f "$OUT.pins"
mv "$OUT.tmp" "$OUT"
echo "tools/freeze.sh: wrote $(grep -vc '^#' "$OUT") pins to $OUT"
