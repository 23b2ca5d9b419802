"""The fastai adapter unchanged on the XLA runtime, 2 XLA CPU devices, against a single-process
CPU ``Learner`` with the same global batch and sample order: parameters, the recorder's losses
and every reported metric (valid loss, accuracy, error_rate, RocAuc, F1Score) after two fits
(the second continues the first's optimizer state), batches and model on the XLA device during
the fit, the user's CPU parameters back after it, ``learn.save`` once and ``learn.load``.
One launch runs every scenario (each launch costs seconds of start-up)."""

from __future__ import annotations

import functools
import os
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

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

N_TRAIN, N_VALID, GLOBAL, EPOCHS, SEED = 40, 23, 8, 2, 5


def _data() -> tuple[TensorDataset, TensorDataset]:
    xs, ys = reference_data(N_TRAIN + N_VALID, 8, 3, seed=2)
    x, y = torch.tensor(xs), torch.tensor(ys)
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


def _model(state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    if state is None:
        torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    if state is not None:  # replica threads share torch's random generator: the weights come from the parent
        model.load_state_dict(state)
    return model


def _metrics() -> list[Any]:
    from fastai.metrics import F1Score, RocAuc, accuracy, error_rate

    return [accuracy, error_rate, RocAuc(), F1Score(average="macro")]


def _opt() -> Any:
    from fastai.optimizer import SGD

    return functools.partial(SGD, mom=0.9)


def _params(model: nn.Module) -> dict[str, list[float]]:
    return {k: v.detach().cpu().reshape(-1).double().tolist() for k, v in model.state_dict().items()}


def _fits(learn: Any) -> tuple[list[list[float]], list[float]]:
    """``fit(EPOCHS)``, then ``fit(1)`` (continuing with the optimizer's momentum); what the
    recorder reported in each (it restarts per fit)."""
    values, losses = [], []
    for epochs in (EPOCHS, 1):
        learn.fit(epochs)
        values += [list(map(float, v)) for v in learn.recorder.values]
        losses += [float(v) for v in learn.recorder.losses]
    return values, losses


def _worker(strategy: pp.Strategy, state: dict[str, torch.Tensor], workdir: str) -> dict[str, Any]:
    from fastai.callback.core import Callback

    install_ordered_sync()  # test support for XLA CPU devices (pytorch/xla#9089)
    rank = strategy.session().rank
    seen: dict[str, str] = {}

    class Devices(Callback):
        def after_pred(self) -> None:
            if self.training:
                seen.update(batch=str(self.xb[0].device), model=str(next(self.model.parameters()).device))

    train, valid = _data()
    model = _model(state)
    user_params = list(model.parameters())
    learn = make_learner(train, valid, model, 99, cbs=[strategy.adapt("fastai"), Devices()], metrics=_metrics(),
                         opt_func=_opt(), valid_bs=5)  # bs=99: the strategy's global batch decides
    values, losses = _fits(learn)
    out: dict[str, Any] = {
        "rank": rank, "seen": seen, "params": _params(learn.model), "values": values, "losses": losses,
        "user_params_back": [p is q for p, q in zip(learn.model.parameters(), user_params)] == [True] * 4,
        "devices_after": sorted({str(t.device) for t in [*learn.model.parameters(), *learn.model.buffers()]}),
        "opt_params_are_model_params": all(p is q for p, q in zip((p for p, *_ in learn.opt.all_params()),
                                                                  learn.model.parameters())),
    }
    own = os.path.join(workdir, f"rank{rank}")
    learn.path = type(learn.path)(own)
    learn.save("ckpt")
    out["wrote_own_dir"] = os.path.exists(os.path.join(own, "models", "ckpt.pth"))
    learn.path = type(learn.path)(os.path.join(workdir, "rank0"))
    with torch.no_grad():
        for p in learn.model.parameters():
            p.add_(1.0)
    learn.load("ckpt")
    out["loaded_equal"] = _params(learn.model) == out["params"]
    return out


def _reference() -> dict[str, Any]:
    """A plain fastai Learner, one CPU process, global batch GLOBAL, the shard's epoch orders."""

    train, valid = _data()
    learn = make_learner(train, valid, _model(), GLOBAL, metrics=_metrics(), opt_func=_opt(), valid_bs=5)
    single_process_order(learn, N_TRAIN, SEED)  # the sharded run's sample order, over one rank
    values, losses = _fits(learn)
    return {"params": _params(learn.model), "values": values, "losses": losses}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return _reference()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    strategy = pp.Strategy(data=2, runtime="xla", timeout=30, batch_size=GLOBAL, seed=SEED)
    return pp.launch(_worker, strategy, nprocs=2, args=(strategy, _model().state_dict(),
                                                        str(tmp_path_factory.mktemp("fastai-xla"))), timeout=240)


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def test_the_learner_trains_on_the_xla_device(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["seen"]["batch"].startswith("xla") and r["seen"]["model"].startswith("xla"), r["seen"]


def test_parameters_match_a_single_process_cpu_learner(results: list[dict[str, Any]],
                                                         reference: dict[str, Any]) -> None:
    want = reference["params"]
    for r in results:
        assert r["params"].keys() == want.keys()
        for name in want:
            assert _close(r["params"][name], want[name]), (r["rank"], name)


def test_reported_metrics_and_losses_equal_single_process(results: list[dict[str, Any]],
                                                          reference: dict[str, Any]) -> None:
    ref = reference
    assert len(ref["values"]) == EPOCHS + 1 and len(ref["values"][0]) == 6  # train/valid loss + 4 metrics
    for r in results:
        for epoch, (got, want) in enumerate(zip(r["values"], ref["values"], strict=True)):
            assert _close(got, want), (r["rank"], epoch, got, want)
        assert _close(r["losses"], ref["losses"]), r["rank"]


def test_after_fit_the_learner_holds_the_users_cpu_parameters(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["user_params_back"] and r["devices_after"] == ["cpu"] and r["opt_params_are_model_params"]


def test_save_once_from_the_checkpoint_role_and_load(results: list[dict[str, Any]]) -> None:
    assert [r["wrote_own_dir"] for r in results] == [True, False]
    assert all(r["loaded_equal"] for r in results)
