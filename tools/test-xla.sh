#!/usr/bin/env bash
# The XLA lane: tests/xla_plugin (the XLA runtime on 2 XLA CPU devices, and the fastai adapter on
# it: test_fastai.py, test_fastai_conformance.py) and the torch runtime's basic tests on torch 2.9,
# in .venv-xla (tools/env-xla.sh). Any pytest arguments replace the
# default selection. Called by tools/test.sh unless POLYPARALLEL_SKIP_XLA=1.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/env-xla.sh" || exit 1
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "$#" -eq 0 ] || [[ "$1" == -* ]]; then
    # The torch runtime on torch 2.9: its runtime, data and plugin tests (the others need
    # Lightning, Ignite or torch 2.13-only features, and run in the main lane).
    set -- "$@" tests/xla_plugin tests/torch_plugin/test_runtime.py tests/torch_plugin/test_data.py \
        tests/torch_plugin/test_grads.py
fi
python -m pytest -p no:cacheprovider "$@"
