"""The fastai callback on 2 gloo processes against a single-process fastai Learner.

One launch runs every scenario (each launch costs seconds): a Learner trained 3 epochs with the
adapter vs a plain Learner with the same global batch and sample order (parameters, the
recorder's losses and every reported metric: accuracy, error_rate, RocAuc, F1Score, valid loss);
the shards of an uneven data set; learn.save once from the checkpoint role, then learn.load.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp
from polyparallel.testing import reference_data
from polyparallel_fastai.testing import make_learner, single_process_order

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

N_TRAIN, N_VALID, GLOBAL, EPOCHS, SEED = 40, 23, 8, 3, 5


def _data() -> tuple[TensorDataset, TensorDataset]:
    xs, ys = reference_data(N_TRAIN + N_VALID, 8, 3, seed=2)
    x, y = torch.tensor(xs), torch.tensor(ys)
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _metrics() -> list[Any]:
    from fastai.metrics import F1Score, RocAuc, accuracy, error_rate

    return [accuracy, error_rate, RocAuc(), F1Score(average="macro")]


def _opt() -> Any:
    from fastai.optimizer import SGD

    return functools.partial(SGD, mom=0.9)


def _params(model: nn.Module) -> dict[str, list[float]]:
    return {k: v.detach().reshape(-1).double().tolist() for k, v in model.state_dict().items()}


def _worker(strategy: pp.Strategy, workdir: str) -> dict[str, Any]:
    from fastai.data.load import DataLoader

    rank = strategy.session().rank
    out: dict[str, Any] = {"rank": rank}
    # -- training parity and metrics ------------------------------------------------------------------
    train, valid = _data()
    learn = make_learner(train, valid, _model(), 99, cbs=[strategy.adapt("fastai")], metrics=_metrics(),
                         opt_func=_opt(), valid_bs=5)  # bs=99: the strategy's global batch decides
    learn.fit(EPOCHS)
    out.update(params=_params(learn.model), values=[list(map(float, v)) for v in learn.recorder.values],
               losses=[float(v) for v in learn.recorder.losses], model_type=type(learn.model).__name__)
    # -- shards of an uneven data set (through the adapter: strategy.shard_data of fastai loaders) ----------
    dl = DataLoader(TensorDataset(torch.arange(37)), bs=4, shuffle=True)
    shards = {}
    for epoch in (0, 1):
        sharded = strategy.shard_data(dl, remainder="uneven")
        sharded.set_epoch(epoch)
        shards[epoch] = [int(i) for (b,) in sharded for i in b]
    valid_shard = strategy.shard_data(DataLoader(TensorDataset(torch.arange(37)), bs=4), remainder="uneven")
    out.update(shards=shards, valid_shard=[int(i) for (b,) in valid_shard for i in b])
    # -- save once from the checkpoint role, then load everywhere --------------------------------------------
    own = os.path.join(workdir, f"rank{rank}")
    learn.path = type(learn.path)(own)
    learn.save("ckpt")  # collective: every rank returns once the file is complete
    out["wrote_own_dir"] = os.path.exists(os.path.join(own, "models", "ckpt.pth"))
    learn.path = type(learn.path)(os.path.join(workdir, "rank0"))
    saved = _params(learn.model)
    with torch.no_grad():
        for p in learn.model.parameters():
            p.add_(1.0)
    learn.load("ckpt")
    out["loaded_equal"] = _params(learn.model) == saved
    return out


def _reference() -> tuple[dict[str, list[float]], list[list[float]], list[float]]:
    """A plain fastai Learner, one process, global batch GLOBAL, the epoch orders of the shard."""

    train, valid = _data()
    learn = make_learner(train, valid, _model(), GLOBAL, metrics=_metrics(), opt_func=_opt(), valid_bs=5)
    single_process_order(learn, N_TRAIN, SEED)  # the sharded run's sample order, over one rank
    learn.fit(EPOCHS)
    return _params(learn.model), [list(map(float, v)) for v in learn.recorder.values], [float(v) for v in learn.recorder.losses]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    strategy = pp.Strategy(data=2, timeout=30, batch_size=GLOBAL, seed=SEED)
    return pp.launch(_worker, strategy, 2, args=(strategy, str(tmp_path_factory.mktemp("fastai"))), timeout=240)


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def test_training_matches_a_single_process_learner(results: list[dict[str, Any]]) -> None:
    params, _, _ = _reference()
    for r in results:
        assert r["model_type"] == "Sequential"  # the user's module again after fit
        assert r["params"].keys() == params.keys()
        for name in params:
            assert _close(r["params"][name], params[name]), (r["rank"], name)


def test_reported_metrics_equal_single_process(results: list[dict[str, Any]]) -> None:
    _, values, losses = _reference()
    assert len(values) == EPOCHS and len(values[0]) == 6  # train_loss valid_loss accuracy error_rate roc_auc f1
    for r in results:
        for epoch, (got, want) in enumerate(zip(r["values"], values)):
            assert _close(got, want), (r["rank"], epoch, got, want)
        assert _close(r["losses"], losses), r["rank"]


def test_uneven_shards_are_disjoint_complete_and_reshuffled(results: list[dict[str, Any]]) -> None:
    for epoch in (0, 1):
        parts = [set(r["shards"][epoch]) for r in results]
        assert parts[0].isdisjoint(parts[1])
        assert parts[0] | parts[1] == set(range(37))
        assert sorted(len(r["shards"][epoch]) for r in results) == [18, 19]
        assert [r["shards"][epoch] for r in results] == [pp.shard_indices(37, d, 2, seed=SEED, epoch=epoch,
                                                                          remainder="uneven") for d in (0, 1)]
    assert results[0]["shards"][0] != results[0]["shards"][1]  # reshuffled per epoch


def test_validation_sees_every_sample_once(results: list[dict[str, Any]]) -> None:
    seen = sorted(i for r in results for i in r["valid_shard"])
    assert seen == list(range(37))


def test_save_writes_once_from_the_checkpoint_role_and_load_restores(results: list[dict[str, Any]]) -> None:
    assert [r["wrote_own_dir"] for r in results] == [True, False]
    assert all(r["loaded_equal"] for r in results)
