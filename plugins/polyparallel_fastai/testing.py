"""The conformance driver of the fastai adapter: the torch reference problem trained and evaluated
by a fastai ``Learner`` carrying ``strategy.adapt("fastai")``.

Reuses :mod:`polyparallel_torch.testing` (model, data, single-process reference), so only the
loop differs: fastai's ``Learner.fit``/``validate``, its ``Recorder`` and metrics.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp
from polyparallel.testing import ConformanceDriver
from polyparallel_torch.testing import (
    LR,
    TorchDriver,
    fill_states,
    flat_params,
    ghost_batch_reference,
    local_states,
    reference_dataset,
    reference_model,
)

__all__ = ["FastaiDriver", "FastaiXlaDriver", "make_learner", "quiet", "single_process_order"]


def quiet(learn: Any) -> Any:
    """``learn`` without progress bars and printed tables (tests read ``learn.recorder``)."""
    from fastai.callback.progress import ProgressCallback

    learn.remove_cb(ProgressCallback)
    learn.logger = lambda *args, **kwargs: None
    return learn


def make_learner(train: Any, valid: Any, model: nn.Module, bs: int, *, cbs: Any = (), metrics: Any = (),
                 shuffle: bool = True, drop_last: bool = True, opt_func: Any = None, valid_bs: int | None = None) -> Any:
    """A plain fastai ``Learner`` on two ``TensorDataset``s (CPU, no workers, SGD at ``LR``)."""
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.optimizer import SGD

    dls = DataLoaders(DataLoader(train, bs=bs, shuffle=shuffle, drop_last=drop_last),
                      DataLoader(valid, bs=valid_bs or bs), device="cpu")
    return quiet(Learner(dls, model, loss_func=nn.functional.cross_entropy, opt_func=opt_func or SGD, lr=LR,
                         metrics=list(metrics), cbs=list(cbs)))


def single_process_order(learn: Any, length: int, seed: int) -> Any:
    """Make a plain one-process ``learn`` read its training set in the order a sharded run sees
    over all its ranks: :func:`polyparallel.shard_indices` over one rank, epoch by epoch (the
    single-process reference of the parity tests). Returns ``learn``."""
    from fastai.callback.core import Callback

    from .data import ShardIndices

    order = ShardIndices(length, 0, 1, seed, True, "pad", length)
    learn.dls.train.get_idxs = order

    class FollowEpoch(Callback):
        def before_train(self) -> None:
            order.epoch = self.epoch

    learn.add_cb(FollowEpoch())
    return learn


class _States:
    """Test callbacks around the adapter's ``before_validate`` (order 8): fill the states with
    values that differ per rank after the model is wrapped (DDP broadcasts at construction), and
    read them before and after the adapter's ``sync_states``."""

    def __init__(self, rank: int):
        from fastai.callback.core import Callback

        record: dict[str, dict[str, list[float]]] = {}
        self.record = record

        def inner(learn: Any) -> nn.Module:
            return learn.model.module if isinstance(learn.model, nn.parallel.DistributedDataParallel) else learn.model

        class Fill(Callback):
            order = 7

            def before_validate(self) -> None:
                fill_states(inner(self.learn), rank)
                record["before"] = {n: t.detach().reshape(-1).double().tolist() for n, t in local_states(inner(self.learn))}

        class Read(Callback):
            order = 9

            def before_validate(self) -> None:
                record["after"] = {n: t.detach().reshape(-1).double().tolist() for n, t in local_states(inner(self.learn))}

        self.callbacks = [Fill(), Read()]


class FastaiDriver(ConformanceDriver):
    """A fastai ``Learner`` with the adapter's callback (data axis); every loader goes through
    ``strategy.shard_data`` (the adapter shards fastai loaders itself, with
    ``polyparallel.shard_indices``)."""

    target = "fastai"
    unsupported = (pp.Topology(data=1, tensor=2), pp.Topology(data=1, pipeline=2))

    def bind(self, strategy: pp.Strategy) -> pp.Strategy:
        """Import fastai (seconds) before the kit starts timing the skipped collective."""
        import fastai.learner  # noqa: F401
        import fastai.metrics  # noqa: F401

        import polyparallel_fastai.callback  # noqa: F401

        return strategy

    def model(self, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The reference model a launched rank trains (a runtime whose ranks are threads of one
        process overrides it: they share torch's random generator)."""
        return reference_model(seed, dtype)

    def shard_indices(self, strategy: pp.Strategy, epoch: int) -> list[int]:
        from fastai.data.load import DataLoader

        loader = DataLoader(TensorDataset(torch.arange(self.dataset_size)), bs=4, shuffle=True)
        sharded = strategy.shard_data(loader, batch_size=self.global_batch, remainder="uneven")
        sharded.set_epoch(epoch)
        return [int(i) for (batch,) in sharded for i in batch]

    def train(self, strategy: pp.Strategy) -> dict[str, list[float]]:
        data_size = strategy.session().topology.size("data")
        dataset = reference_dataset(self.dataset_size)
        # drop_last: full global batches only, as the reference; one epoch holds `steps` of them.
        assert self.dataset_size // self.global_batch == self.steps
        learn = make_learner(dataset, dataset, self.model(strategy.seed), self.global_batch // data_size,
                             cbs=[strategy.adapt("fastai")])
        learn.fit(1)
        return flat_params(learn.model)

    def train_reference(self, data_size: int) -> dict[str, list[float]]:
        return ghost_batch_reference(self.steps, self.global_batch, data_size, 0, self.dataset_size)

    def evaluate(self, strategy: pp.Strategy) -> dict[str, float]:
        from fastai.metrics import accuracy

        dataset = reference_dataset(self.dataset_size, torch.float64)
        learn = make_learner(dataset, dataset, self.model(strategy.seed, torch.float64), 4,
                             cbs=[strategy.adapt("fastai")], metrics=[accuracy])
        loss, acc = learn.validate()
        return {"loss": float(loss), "accuracy": float(acc)}

    def evaluate_reference(self) -> dict[str, float]:
        """The torch runtime's whole-data-set metrics (the same model and data)."""
        driver = TorchDriver()
        driver.dataset_size = self.dataset_size
        return driver.evaluate_reference()

    def sync_states(self, strategy: pp.Strategy) -> dict[str, dict[str, Any]]:
        dataset = reference_dataset(self.dataset_size)
        states = _States(strategy.session().rank)
        learn = make_learner(dataset, dataset, self.model(strategy.seed), 4,
                             cbs=[strategy.adapt("fastai"), *states.callbacks])
        learn.validate()
        policy = strategy.state_policy
        before, after = states.record["before"], states.record["after"]
        return {n: {"action": policy.action_for(n), "before": before[n], "after": after[n]} for n in before}

    def skip_collective(self, strategy: pp.Strategy, skip: bool) -> None:
        """Every rank validates a Learner with the adapter (wrapping and state sync together);
        the skipping rank's Learner has no recorder, so it never joins the metric reduction."""
        dataset = reference_dataset(self.dataset_size)
        learn = make_learner(dataset, dataset, self.model(strategy.seed), 4, cbs=[strategy.adapt("fastai")])
        if skip:
            learn.remove_cb(learn.recorder)
        learn.validate()


class FastaiXlaDriver(FastaiDriver):
    """The fastai adapter's conformance driver (:class:`FastaiDriver`: the same ``Learner``,
    callback and loops, unchanged) under a strategy with ``runtime="xla"``: each rank is an XLA
    CPU device served by a thread, syncs ordered by
    :func:`polyparallel_xla.testing.install_ordered_sync`, models seeded one thread at a time
    (:func:`polyparallel_xla.testing.seeded_model`). Here, not in the XLA plugin: a runtime
    imports no framework adapter."""

    startup_seconds = 90.0

    def bind(self, strategy: pp.Strategy) -> pp.Strategy:
        from polyparallel_xla.testing import install_ordered_sync

        install_ordered_sync()
        return super().bind(strategy)

    def model(self, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
        from polyparallel_xla.testing import seeded_model

        return seeded_model(seed, dtype)
