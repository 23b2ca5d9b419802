"""``polyparallel_xla/runtime.py``, ``ops.py`` and ``launch.py`` on 2 XLA CPU devices: a plain torch
loop matches a single-process CPU reference, shards partition an uneven data set, the module
lives on the device, ranks out of step fail naming both, bad input is refused before launch.
The scenarios share one launch (each costs seconds of start-up)."""

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

N, FEATURES, CLASSES, GLOBAL_BATCH, STEPS, LR = 37, 6, 3, 8, 4, 0.2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, FEATURES, generator=g)
    return TensorDataset(x, (x[:, :CLASSES]).argmax(-1))


def scenarios(state: dict[str, torch.Tensor]) -> dict:
    import torch_xla

    install_ordered_sync()
    strategy = pp.Strategy(data=2, runtime="xla", timeout=20)
    session = strategy.session()
    out: dict = {"rank": session.rank, "world": session.world_size}
    # Shards of an uneven data set (remainder "uneven": every sample once).
    idx = strategy.shard_data(TensorDataset(torch.arange(N)), batch_size=GLOBAL_BATCH, remainder="uneven", shuffle=True)
    out["shard"] = [int(i) for (b,) in idx for i in b.cpu()]
    out["batch_device"] = str(next(iter(idx))[0].device)
    # A plain torch loop; initial weights built before launching (replica threads share the RNG).
    model = make_model()
    model.load_state_dict(state)
    model = strategy.wrap_model(model)
    out["param_device"] = str(next(model.parameters()).device)
    loader = strategy.shard_data(dataset(), batch_size=GLOBAL_BATCH, shuffle=False, remainder="drop")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        strategy.sync_grads(model)
        opt.step()
        torch_xla.sync()
    out["params"] = {k: v.cpu() for k, v in model.state_dict().items()}
    # Ranks at different operations: each fails naming both, before any XLA collective.
    other = pp.Strategy(data=2, runtime="xla", timeout=10)
    start = time.monotonic()
    try:
        if session.rank == 0:
            other.reduce_metrics({"loss": 1.0})  # rank 0's side
        else:
            other.sync_states({"w": torch.ones(2, device=torch_xla.device())})  # rank 1's side
    except pp.CollectiveError as exc:
        out["mismatch"] = (type(exc).__name__, exc.operation, exc.axis, exc.rank, str(exc), time.monotonic() - start)
    return out


def reference() -> dict[str, torch.Tensor]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = dataset().tensors
    for step in range(STEPS):
        sl = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
        opt.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def launched() -> list[dict]:
    strategy = pp.Strategy(data=2, runtime="xla", timeout=20)
    return pp.launch(scenarios, strategy, nprocs=2, args=(make_model().state_dict(),), timeout=240)


def test_ranks_are_the_devices(launched):
    assert [(r["rank"], r["world"]) for r in launched] == [(0, 2), (1, 2)]


def test_wrap_model_puts_the_module_on_the_xla_device(launched):
    assert all(r["param_device"].startswith("xla") and r["batch_device"].startswith("xla") for r in launched)


def test_shards_are_disjoint_and_cover_an_uneven_data_set(launched):
    a, b = launched[0]["shard"], launched[1]["shard"]
    assert not set(a) & set(b) and sorted(a + b) == list(range(N)) and {len(a), len(b)} == {18, 19}


def test_plain_torch_loop_matches_single_process_reference(launched):
    want = reference()
    for r in launched:
        for name, value in want.items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-5, atol=1e-6)


def test_ranks_at_different_operations_fail_naming_both(launched):
    for r in launched:
        kind, operation, axis, rank, message, elapsed = r["mismatch"]
        assert kind == "CollectiveError" and axis == "data" and rank == r["rank"] and elapsed < 10
        assert "reduce_metrics (loss:mean[1]) on rank 0" in message and "sync_states (1 [w:broadcast" in message
        assert "on rank 1" in message
        # Where each side was called: the user's lines, as the torch runtime reports them.
        zero, one = _line("rank 0's side"), _line("rank 1's side")
        mine, theirs = (zero, one) if r["rank"] == 0 else (one, zero)
        assert f"(called at test_runtime.py:{mine} and test_runtime.py:{theirs})" in message, message
        assert f"  rank 0: reduce_metrics #1 (loss:mean[1]) at test_runtime.py:{zero}" in message, message


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "_line(" not in line)


def _never() -> None:  # pragma: no cover - refused before starting
    raise AssertionError("started")


def test_bad_input_is_refused_before_launch(monkeypatch):
    start = time.monotonic()
    with pytest.raises(pp.UnsupportedTopologyError, match="cannot run tensor=2"):
        pp.launch(_never, pp.Strategy(data=2, tensor=2, runtime="xla"), nprocs=4)
    with pytest.raises(pp.TopologyError, match="global batch size 7"):
        pp.launch(_never, pp.Strategy(data=-1, batch_size=7, runtime="xla"), nprocs=2)
    with pytest.raises(pp.TopologyError, match="CPU_NUM_DEVICES=2 gives 2 devices. Set CPU_NUM_DEVICES=4"):
        pp.launch(_never, pp.Strategy(data=-1, runtime="xla"), nprocs=4)
    with pytest.raises(TypeError, match="picklable"):
        pp.launch(lambda: None, pp.Strategy(data=2, runtime="xla"), nprocs=2)
    monkeypatch.delenv("PJRT_DEVICE")
    with pytest.raises(pp.TopologyError, match="needs PJRT_DEVICE"):
        pp.launch(_never, pp.Strategy(data=2, runtime="xla"), nprocs=2)
    assert time.monotonic() - start < 5
