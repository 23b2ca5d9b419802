"""FSDP2's all-gathers and reduce-scatters in the collective trace and hang reports
(polyparallel_torch.fsdp_trace): a rank in FSDP's forward while its peer runs a polyparallel
operation is named with its FSDP collective and its line; the trace holds one entry per forward
and per backward; the recording changes no value."""

import os

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel import _trace_report
from polyparallel_torch.testing import source_line

pytestmark = pytest.mark.multiprocess

TIMEOUT = 6.0


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _rank_one_trains_while_rank_zero_reduces():
    s = pp.Strategy(data=2, zero=3, timeout=TIMEOUT)
    model = s.wrap_model(_net())
    model(torch.ones(2, 8)).sum().backward()
    s.reduce_metrics({"x": 1.0})
    if s.rank == 0:
        s.reduce_metrics({"loss": pp.Mean(1.0, 1)})  # rank 0 reduces its metrics
    else:
        model(torch.ones(2, 8)).sum().backward()  # rank 1 runs forward and backward
    return s.rank


@pytest.mark.timeout(120)
def test_a_peer_in_fsdps_forward_is_named_with_its_all_gather_and_line():
    # Before: rank 1's last collective was "reduce_metrics #2" (FSDP's all-gathers were not
    # recorded) and its own error gloo's bare timeout raised in FSDP's forward hook.
    with pytest.raises(pp.LaunchError) as info:
        pp.launch(_rank_one_trains_while_rank_zero_reduces, pp.Strategy(data=2, zero=3, timeout=TIMEOUT), 2,
                  timeout=100)
    message, here = str(info.value), os.path.basename(__file__)
    forward = source_line(_rank_one_trains_while_rank_zero_reduces, "rank 1 runs forward")
    reduce = source_line(_rank_one_trains_while_rank_zero_reduces, "rank 0 reduces")
    first = message.splitlines()[0]
    assert first.startswith("rank 0 of 2 failed: CollectiveTimeout: reduce_metrics #3 over the 'data' axis"), message
    assert f"FSDP all-gather ({here}:{forward} via _fsdp_collectives.py:" in first, message
    assert f"rank 0 waits in reduce_metrics #3 ({here}:{reduce})" in first, message
    # Rank 1's own error, when its gloo timeout comes before the launcher stops it (on torch 2.9 it
    # may not), is the runtime's timeout naming its FSDP collective and rank 0's operation.
    peer = next(line for line in message.splitlines() if line.startswith("  rank 1: "))
    if peer == "  rank 1: stopped by the launcher":
        return
    assert peer.startswith("  rank 1: CollectiveTimeout: FSDP all-gather of unit 0 over the 'data' axis did not "
                           "complete within the strategy's timeout of 6 s on rank 1"), message
    assert "reduce_metrics #3" in peer, message


def _train_steps(strategy):
    model = strategy.wrap_model(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        loss = model(torch.ones(2, 8)).sum()  # forward
        loss.backward()  # backward
        opt.step()
        strategy.reduce_metrics({"loss": loss.detach()})
    from polyparallel_torch import fsdp_trace

    return fsdp_trace.is_installed(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [2, 3])
def test_the_trace_holds_one_fsdp_entry_per_forward_and_per_backward(tmp_path, zero):
    strategy = pp.Strategy(data=2, zero=zero)
    assert pp.launch(_train_steps, strategy, 2, args=(strategy,), timeout=100, trace_dir=str(tmp_path)) == [True, True]
    traces = _trace_report.read_dir(str(tmp_path))
    assert sorted(traces) == [0, 1]
    here = os.path.basename(__file__)
    forward, backward = (source_line(_train_steps, "# forward"), source_line(_train_steps, "# backward"))
    for rank, trace in traces.items():
        entries = [e for e in trace["entries"] if e["axis"] == "data"]
        ops = [e["operation"] for e in entries]
        # Per step: the forward's all-gathers (one entry), the backward's collectives (one entry,
        # named by its last: the root's reduce-scatter), then reduce_metrics.
        assert ops[-6:] == ["FSDP all-gather", "FSDP reduce-scatter", "reduce_metrics"] * 2, (rank, ops)
        fwd, bwd = entries[-3], entries[-2]
        assert fwd["user"].endswith(f"{here}:{forward}") and bwd["user"].endswith(f"{here}:{backward}"), (fwd, bwd)
        assert fwd["state"] == bwd["state"] == "done" and fwd["seq"] is None, (fwd, bwd)
        # 3 units (the Linears; the root holds no parameter and gathers nothing), the last gathered
        # one named: 17 parameters on each of 2 ranks.
        assert fwd["detail"] == "unit 4: 34 float32, 3rd collective of this forward", fwd
        # zero=3 re-gathers the units resharded after forward (0 and 2; the last stays gathered),
        # then every unit reduce-scatters, unit 0 last (16 x 8 + 16 gradients).
        count = "5th" if zero == 3 else "3rd"
        assert bwd["detail"] == f"unit 0: 144 float32, {count} collective of this backward", bwd


def _losses(strategy, record: bool):
    from polyparallel_torch import fsdp_trace

    os.environ[fsdp_trace.ENV] = "1" if record else "0"
    try:
        model = strategy.wrap_model(_net())
    finally:
        del os.environ[fsdp_trace.ENV]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + strategy.rank)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    import polyparallel_torch as pt

    return {"installed": fsdp_trace.is_installed(model), "losses": losses,
            "params": {k: v.float().tolist() for k, v in pt.full_state(model).items()}}


def _numerics(strategy):
    out = {}
    for label, s in (("zero=3", strategy), ("zero=2", strategy.replace(zero=2)),
                     ("zero=3 bf16-mixed", strategy.replace(precision="bf16-mixed")),
                     ("zero=3 bf16 reduce", strategy.replace(precision=pp.PrecisionPolicy(
                         compute_dtype="bfloat16", reduce_dtype="bfloat16")))):
        out[label] = {"on": _losses(s, True), "off": _losses(s, False)}
    return out


@pytest.mark.timeout(180)
def test_recording_changes_no_loss_nor_parameter_bit_for_bit(run):
    strategy = pp.Strategy(data=2, zero=3)
    for r in run(_numerics, strategy, 2, strategy, timeout=160):
        for label, got in r.items():
            assert got["on"]["installed"] and not got["off"]["installed"], label
            assert got["on"]["losses"] == got["off"]["losses"], (label, got)
            assert got["on"]["params"] == got["off"]["params"], label


def test_the_switch_and_the_api_check():
    from polyparallel_torch import fsdp_trace

    assert fsdp_trace.supported()  # torch >= 2.9 offers set_custom_all_gather / set_custom_reduce_scatter
    for value, on in (("0", False), ("off", False), ("1", True), ("", True)):
        os.environ[fsdp_trace.ENV] = value
        try:
            assert fsdp_trace.enabled() is on, value
        finally:
            del os.environ[fsdp_trace.ENV]
    assert fsdp_trace.enabled()
    assert not fsdp_trace.is_installed(nn.Linear(2, 2))
