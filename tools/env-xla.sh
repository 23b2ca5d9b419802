#!/usr/bin/env bash
# The XLA lane's environment, .venv-xla: torch 2.9.0 and torch_xla 2.9.0 (torch_xla links against
# that torch exactly, so it cannot share .venv's torch 2.13), the project editable without its
# other frameworks, and the test tools. About 4 GB of wheels and 2-3 minutes the first time; a
# stamp of the dependency files skips the install when nothing changed. fastai is installed too,
# so that the fastai adapter's XLA tests run here. Sourced by tools/test-xla.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${POLYPARALLEL_XLA_VENV:-$ROOT/.venv-xla}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.polyparallel-stamp"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/tools/env-xla.sh" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
    PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
    "${PIP[@]}" "torch==2.9.0" "torch_xla==2.9.0"
    # The project itself without dependencies (its `all` extra pulls torch 2.13), then what the
    # lane's tests import.
    "${PIP[@]}" --no-deps -e "$ROOT"
    "${PIP[@]}" "pluggy>=1.3" "click>=8.1" "pytest>=7" "pytest-timeout>=2.1" "hypothesis>=6" numpy
    # fastai (the fastai adapter runs on the XLA runtime unchanged; tests/fastai_plugin/test_xla*.py).
    # torch stays pinned in the same resolve: fastai requires torchvision, whose newest release
    # requires a newer torch; PyPI's torchvision 0.24.0 is built for PyPI's torch 2.9.0 and loads.
    "${PIP[@]}" "torch==2.9.0" "torchvision==0.24.0" "fastai>=2.8,<2.9" scikit-learn
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
