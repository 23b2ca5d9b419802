"""The fastai adapter at ``Strategy(precision="bf16-mixed")`` on the XLA runtime (2 XLA CPU
devices): fastai's ``MixedPrecision`` autocasts on the ``"xla"`` device (bfloat16 forward,
float32 parameters), and data=2 equals a single-process CPU ``Learner`` under fastai's bf16
``MixedPrecision`` within the runtime's bfloat16 tolerance (parameters within 2.5e-3: XLA and
the CPU round different bfloat16 kernels)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch_xla")
pytest.importorskip("fastai")
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import polyparallel as pp  # noqa: E402
from polyparallel.testing import reference_data  # noqa: E402
from polyparallel_fastai.testing import make_learner, single_process_order  # noqa: E402
from polyparallel_xla.testing import install_ordered_sync  # noqa: E402

# Slow (~40 s): the XLA lane runs the default suite; test_precision.py is its bf16 test.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]

N_TRAIN, N_VALID, GLOBAL, EPOCHS, SEED = 40, 8, 8, 2, 5
BF16_ATOL = 2.5e-3


def _data() -> tuple[TensorDataset, TensorDataset]:
    xs, ys = reference_data(N_TRAIN + N_VALID, 8, 3, seed=2)
    x, y = torch.tensor(xs), torch.tensor(ys)
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


class _Recording(nn.Module):
    def __init__(self, state: dict[str, torch.Tensor] | None = None):
        super().__init__()
        if state is None:
            torch.manual_seed(3)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
        if state is not None:  # replica threads share torch's random generator: the weights come from the parent
            self.load_state_dict(state)
        self.dtypes: set[str] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.training:
            self.dtypes.add(str(out.dtype))
        return out


def _params(model: nn.Module) -> dict[str, list[float]]:
    return {n: p.detach().cpu().reshape(-1).double().tolist() for n, p in model.named_parameters()}


def _worker(strategy: pp.Strategy, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    install_ordered_sync()
    train, valid = _data()
    model = _Recording(state)
    learn = make_learner(train, valid, model, 99, cbs=[strategy.adapt("fastai")])  # the strategy's batch decides
    learn.fit(EPOCHS)
    return {"params": _params(model), "dtypes": sorted(model.dtypes),
            "param_dtype": str(next(model.parameters()).dtype)}


def _reference() -> dict[str, list[float]]:
    from fastai.callback.fp16 import MixedPrecision

    from polyparallel_fastai.precision import device_before_fit

    class CpuMixedPrecision(MixedPrecision):  # fastai's, autocasting where the model is
        before_fit = device_before_fit

    train, valid = _data()
    model = _Recording()
    learn = make_learner(train, valid, model, GLOBAL, cbs=[CpuMixedPrecision(amp_mode="bf16")])
    single_process_order(learn, N_TRAIN, SEED)
    learn.fit(EPOCHS)
    return _params(model)


def test_bf16_mixed_fastai_on_xla_equals_one_cpu_learner_within_tolerance():
    strategy = pp.Strategy(data=2, runtime="xla", timeout=30, batch_size=GLOBAL, seed=SEED, precision="bf16-mixed")
    results = pp.launch(_worker, strategy, nprocs=2, args=(strategy, _Recording().state_dict()), timeout=240)
    want = _reference()
    for r in results:
        assert r["dtypes"] == ["torch.bfloat16"] and r["param_dtype"] == "torch.float32", r
        worst = max(abs(x - y) for name in want for x, y in zip(r["params"][name], want[name]))
        assert worst <= BF16_ATOL, worst
