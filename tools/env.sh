#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with everything the demo, the
# tests and the documentation site need. Sourced by tools/test.sh, tools/demo.sh and tools/docs.sh;
# safe to run again (a stamp of the dependency files skips the install when nothing changed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${POLYPARALLEL_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
# The versions the suite was tested with (tools/constraints.txt, written by tools/freeze.sh), so a
# fresh clone installs what CI tested. POLYPARALLEL_CONSTRAINTS= (empty) installs the newest
# releases pyproject.toml admits instead (use another POLYPARALLEL_VENV for that: CONTRIBUTING.md).
CONSTRAINTS="${POLYPARALLEL_CONSTRAINTS-$ROOT/tools/constraints.txt}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.polyparallel-stamp"
WANT="$( (cat "$ROOT/pyproject.toml" "$ROOT/tools/env.sh" "$ROOT/examples/third_party_plugin/pyproject.toml"
          echo "constraints: ${CONSTRAINTS:-none}"; [ -z "$CONSTRAINTS" ] || cat "$CONSTRAINTS") | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
    PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
    [ -z "$CONSTRAINTS" ] || PIP+=(-c "$CONSTRAINTS")
    # torch first, pinned to the CPU wheel this machine serves locally; later installs of
    # "torch>=2.13,<2.14" are then satisfied and download nothing.
    "${PIP[@]}" "torch==2.13.0"
    # DeepSpeed (extra `deepspeed`) installs as pure Python: DS_BUILD_OPS=0 builds no op now; the
    # one op the CPU path needs (shared-memory collectives) is compiled on first use and cached in
    # TORCH_EXTENSIONS_DIR (below). Set for this install only.
    DS_BUILD_OPS=0 "${PIP[@]}" -e "$ROOT[all,test,docs]" -e "$ROOT/examples/third_party_plugin"
    # fastai requires torchvision, and PyPI's torchvision is built against PyPI's CUDA torch: next
    # to the CPU wheel above its operators cannot load, and importing it raises ("operator
    # torchvision::nms does not exist") — which breaks `import pytorch_lightning` (torchmetrics
    # imports torchvision when it is installed). polyparallel uses fastai's basics, tabular and
    # text parts, which never import torchvision, so a torchvision that cannot load is removed;
    # one that matches the installed torch (e.g. both from PyPI) is kept.
    if ! "$VENV/bin/python" -c "import torchvision" >/dev/null 2>&1 \
        && "$VENV/bin/python" -m pip show -q torchvision >/dev/null 2>&1; then
        echo "tools/env.sh: removing torchvision: it does not load against this torch (fastai.vision needs a" \
             "torchvision built for the installed torch; polyparallel does not)" >&2
        "$VENV/bin/python" -m pip uninstall -y -q torchvision
    fi
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# DeepSpeed compiles its CPU ops on first use (~80 s) into TORCH_EXTENSIONS_DIR; keep that build in
# a project-local cache so later runs (tests, demo, benchmarks) reuse it. Only the shells that
# source this script (tools/test.sh, tools/demo.sh, benchmarks/run.sh) see it; the user's
# environment and an `import polyparallel_deepspeed` are left alone. DS_ACCELERATOR=cpu skips
# DeepSpeed's accelerator probe on this CPU-only machine.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.torch_extensions}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
