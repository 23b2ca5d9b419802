#!/usr/bin/env bash
# The whole test suite, from a fresh clone: creates .venv, installs, then runs the linter (ruff),
# the type checker (mypy), the layer contracts (lint-imports: pyproject.toml's [tool.importlinter]),
# the documentation site's strict build (tools/docs.sh) and pytest (tests/docs runs the docs' code
# blocks). All of them run; the script fails if any of them failed.
#   bash tools/test.sh                 # default suite
#   bash tools/test.sh --runslow       # include tests marked slow
#   bash tools/test.sh tests/core -k topology   # any pytest arguments (lint and types still run)
#   POLYPARALLEL_SKIP_LANES=1 bash tools/test.sh   # without the extra lanes (oldest Lightning, XLA)
#   POLYPARALLEL_SKIP_XLA=1 bash tools/test.sh     # without the XLA lane only (tools/test-xla.sh)
#   POLYPARALLEL_SKIP_SLURM=1 bash tools/test.sh   # without the SLURM lane only (tools/test-slurm.sh)
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
echo "== lint-imports (layers: the core imports no plugin, runtimes no adapter, adapters not each other; no cycles)"
lint-imports --no-cache | sed -n "/^Contracts/,\$p" || failed+=(lint-imports)  # pipefail: lint-imports decides
echo "== docs (mkdocs build --strict: links, anchors, snippets, API reference; tools/docs.sh)"
MKDOCS=mkdocs bash "$ROOT/tools/docs.sh" --quiet || failed+=(docs)
echo "== pytest"
whole_suite=0
if [ "$#" -eq 0 ] || [[ "$1" == -* ]]; then
    whole_suite=1
    set -- "$@" tests examples/third_party_plugin/tests
fi
python -m pytest -p no:cacheprovider "$@" || failed+=(pytest)
# Lane: the oldest Lightning minor pyproject declares (its own venv, tools/env-lightning-oldest.sh),
# a subset of tests/lightning_plugin (both namespaces, a real fit, conformance data=2, stage 3).
# Runs with the whole suite only; POLYPARALLEL_SKIP_LANES=1 skips it (e.g. locally).
if [ "$whole_suite" = 1 ] && [ "${POLYPARALLEL_SKIP_LANES:-0}" != 1 ]; then
    echo "== pytest, oldest Lightning lane"
    if bash "$ROOT/tools/env-lightning-oldest.sh"; then
        "${POLYPARALLEL_LIGHTNING_OLDEST_VENV:-$ROOT/.venv-lightning-oldest}/bin/python" -m pytest -p no:cacheprovider \
            tests/lightning_plugin/test_plugin.py tests/lightning_plugin/test_sharded.py \
            tests/lightning_plugin/test_conformance.py::TestLightningData2 tests/lightning_plugin/test_checkpoint.py \
            tests/lightning_plugin/test_strategy.py -k "not hybrid_checkpoints" || failed+=(lightning-oldest)
    else
        failed+=(lightning-oldest-env)
    fi
fi
# Lane: XLA (its own environment: torch_xla 2.9.0 needs torch 2.9.0), tools/test-xla.sh. Runs with
# the whole suite only; POLYPARALLEL_SKIP_LANES=1 or POLYPARALLEL_SKIP_XLA=1 skips it.
if [ "$whole_suite" = 1 ] && [ "${POLYPARALLEL_SKIP_LANES:-0}" != 1 ] && [ "${POLYPARALLEL_SKIP_XLA:-0}" != 1 ]; then
    echo "== pytest (XLA lane: tools/test-xla.sh)"
    bash "$ROOT/tools/test-xla.sh" || failed+=(pytest-xla)
fi
# Lane: SLURM (a real slurmctld/slurmd/munged on this host, as root: it installs slurm-wlm and munge
# with apt when missing and stops what it started), tools/test-slurm.sh: srun and sbatch jobs equal
# `polyparallel launch`. Whole suite only; POLYPARALLEL_SKIP_LANES=1 or POLYPARALLEL_SKIP_SLURM=1 skips it.
if [ "$whole_suite" = 1 ] && [ "${POLYPARALLEL_SKIP_LANES:-0}" != 1 ] && [ "${POLYPARALLEL_SKIP_SLURM:-0}" != 1 ]; then
    echo "== pytest (SLURM lane: tools/test-slurm.sh)"
    POLYPARALLEL_VENV="${POLYPARALLEL_VENV:-$ROOT/.venv}" bash "$ROOT/tools/test-slurm.sh" || failed+=(pytest-slurm)
fi
if [ "${#failed[@]}" -gt 0 ]; then
    echo "tools/test.sh: failed: ${failed[*]}" >&2
    exit 1
fi
