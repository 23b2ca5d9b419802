"""``Strategy(precision=)`` on the XLA runtime (2 XLA CPU devices): bf16-mixed (the forward under
``torch.autocast("xla", dtype=torch.bfloat16)``, float32 parameters and outputs) and bf16-true
(the module cast to bfloat16) at data=2 equal one XLA device within the torch runtime's bfloat16
tolerance (``tests/torch_plugin/test_precision.py``: parameters within 2.5e-3 at bf16-mixed,
1e-2 at bf16-true, losses within 1%), and both differ from float32 by more than rounding noise of
float32 (the narrow dtype was used); fp16-mixed and dtypes other than the presets are refused
before any process starts, with the reason.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch_xla")
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import polyparallel as pp  # noqa: E402
from polyparallel_xla.testing import install_ordered_sync  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

N, FEATURES, CLASSES, GLOBAL_BATCH, STEPS, LR = 64, 6, 3, 8, 8, 0.2
BF16_ATOL, BF16_TRUE_ATOL, LOSS_RTOL = 2.5e-3, 1e-2, 1e-2
PRECISIONS = ("32", "bf16-mixed", "bf16-true")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, FEATURES, generator=g)
    return TensorDataset(x, (x[:, :CLASSES]).argmax(-1))


def train(state: dict[str, torch.Tensor], data: int) -> dict:
    """Per precision: the dtype the first layer computes in, the output's, the parameters', the
    loss of every step (reduced over data) and the final parameters (as float32)."""
    import torch_xla

    install_ordered_sync()
    out: dict = {}
    for name in PRECISIONS:
        strategy = pp.Strategy(data=data, runtime="xla", timeout=30, precision=name)
        model = make_model()
        model.load_state_dict(state)
        model = strategy.wrap_model(model)
        seen: list[torch.dtype] = []
        model[0].register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.dtype))
        loader = strategy.shard_data(dataset(), batch_size=GLOBAL_BATCH, shuffle=False, remainder="drop")
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for step, (x, y) in enumerate(loader):
            if step == STEPS:
                break
            opt.zero_grad()
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.float(), y)
            loss.backward()
            strategy.sync_grads(model)
            opt.step()
            torch_xla.sync()
            losses.append(strategy.reduce_metrics({"loss": loss.detach()})["loss"])
        out[name] = {"compute": str(seen[0]), "output": str(logits.dtype),
                     "param_dtype": str(next(model.parameters()).dtype), "losses": [float(v) for v in losses],
                     "params": {k: v.detach().float().cpu() for k, v in model.state_dict().items()}}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    state = make_model().state_dict()
    two = pp.launch(train, pp.Strategy(data=2, runtime="xla"), nprocs=2, args=(state, 2), timeout=240)
    with pytest.MonkeyPatch.context() as mp:  # one XLA device: its own supervisor process
        mp.setenv("CPU_NUM_DEVICES", "1")
        (one,) = pp.launch(train, pp.Strategy(data=1, runtime="xla"), nprocs=1, args=(state, 1), timeout=240)
    return two, one


def test_bf16_mixed_autocasts_on_the_xla_device(runs):
    two, one = runs
    for r in (*two, one):
        assert r["bf16-mixed"]["compute"] == "torch.bfloat16"
        assert r["bf16-mixed"]["output"] == "torch.float32" and r["bf16-mixed"]["param_dtype"] == "torch.float32"
        assert r["bf16-true"]["compute"] == r["bf16-true"]["param_dtype"] == "torch.bfloat16"
        assert r["32"]["compute"] == "torch.float32"


@pytest.mark.parametrize("name, atol", [("32", 1e-5), ("bf16-mixed", BF16_ATOL), ("bf16-true", BF16_TRUE_ATOL)])
def test_data_2_equals_one_device_within_the_bf16_tolerance(runs, name, atol):
    two, one = runs
    want = one[name]
    for r in two:
        for key, value in want["params"].items():
            torch.testing.assert_close(r[name]["params"][key], value, atol=atol, rtol=0)
        torch.testing.assert_close(torch.tensor(r[name]["losses"]), torch.tensor(want["losses"]), rtol=LOSS_RTOL,
                                   atol=0)
    if name != "32":  # the narrow dtype was used: further from float32 than float32's own rounding
        gap = max((one[name]["params"][k] - one["32"]["params"][k]).abs().max().item() for k in want["params"])
        assert gap > 1e-5


def _never() -> None:  # pragma: no cover - refused before starting
    raise AssertionError("started")


def test_fp16_and_custom_dtypes_are_refused_before_launch():
    start = time.monotonic()
    with pytest.raises(pp.UnsupportedTopologyError, match="cannot run precision PrecisionPolicy\\('fp16-mixed'\\): "
                                                          "float16 needs loss scaling"):
        pp.launch(_never, pp.Strategy(data=2, runtime="xla", precision="fp16-mixed"), nprocs=2)
    with pytest.raises(pp.UnsupportedTopologyError, match="maps the presets '32', 'bf16-mixed' and 'bf16-true'"):
        pp.launch(_never, pp.Strategy(data=2, runtime="xla", precision=pp.PrecisionPolicy(reduce_dtype="bfloat16")),
                  nprocs=2)
    assert time.monotonic() - start < 5
