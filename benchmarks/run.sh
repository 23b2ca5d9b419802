#!/usr/bin/env bash
# Every ratio benchmark, one after the other (never concurrently: they share 2 cores), each
# comparing polyparallel with hand-written native code side by side in one process tree.
# Tables go to stdout and to benchmarks/results/latest.md; figures to benchmarks/results/*.json.
#   bash benchmarks/run.sh            # full runs
#   bash benchmarks/run.sh --quick    # a smoke run: fewer repeats everywhere
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1
mkdir -p benchmarks/results
QUICK=()
if [ "${1:-}" = "--quick" ]; then QUICK=(--quick); fi
OUT=benchmarks/results/latest.md
{
    echo "# polyparallel benchmarks ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc --all) cores)"
    echo; echo '## torch runtime'; echo '```'
    timeout -k 10 1200 python benchmarks/bench_torch.py "${QUICK[@]}" --json benchmarks/results/torch.json
    echo '```'; echo; echo '## Collective trace (recording on/off)'; echo '```'
    timeout -k 10 1200 python benchmarks/bench_trace.py "${QUICK[@]}" --json benchmarks/results/trace.json
    echo '```'; echo; echo '## Lightning adapter'; echo '```'
    timeout -k 10 1200 python benchmarks/bench_lightning.py "${QUICK[@]}" --json benchmarks/results/lightning.json
    echo '```'; echo; echo '## Ignite adapter'; echo '```'
    timeout -k 10 1200 python benchmarks/bench_ignite.py "${QUICK[@]}" --json benchmarks/results/ignite.json
    echo '```'; echo; echo '## fastai adapter'; echo '```'
    timeout -k 10 1200 python benchmarks/bench_fastai.py "${QUICK[@]}" --json benchmarks/results/fastai.json
    echo '```'; echo; echo '## JAX Model.fit'; echo '```'
    timeout -k 10 1200 python benchmarks/bench_jax.py "${QUICK[@]}" --json benchmarks/results/jax.json
    echo '```'; echo; echo '## Sharding (zero=3, FSDP2)'; echo '```'
    timeout -k 10 1200 python benchmarks/bench_sharding.py "${QUICK[@]}" --json benchmarks/results/sharding.json
    echo '```'; echo; echo '## Precision (bf16-mixed: DDP + autocast, FSDP2 MixedPrecisionPolicy)'; echo '```'
    timeout -k 10 1500 python benchmarks/bench_precision.py "${QUICK[@]}" --json benchmarks/results/precision.json
    echo '```'; echo; echo '## Checkpoints (data=2 x tensor=2)'; echo '```'
    timeout -k 10 1200 python benchmarks/bench_checkpoint.py "${QUICK[@]}" --json benchmarks/results/checkpoint.json
    echo '```'; echo; echo '## DeepSpeed adapter'; echo '```'
    timeout -k 10 1200 python benchmarks/bench_deepspeed.py "${QUICK[@]}" --json benchmarks/results/deepspeed.json
    echo '```'
    # XLA on CPU, information only, in the XLA lane's environment when it exists (tools/env-xla.sh).
    XLA_PY="${POLYPARALLEL_XLA_VENV:-$ROOT/.venv-xla}/bin/python"
    if [ -x "$XLA_PY" ]; then
        echo; echo '## XLA runtime on CPU (information only)'; echo '```'
        timeout -k 10 900 "$XLA_PY" benchmarks/bench_xla.py "${QUICK[@]}" --json benchmarks/results/xla.json
        echo '```'
    fi
} 2> >(grep -v -e '^W1' -e 'Warning' >&2) | tee "$OUT"
