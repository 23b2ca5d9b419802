"""Lightning's declared surface (:mod:`polyparallel_lightning.surface`): it covers everything the
installed Lightning lists (both namespaces), its published table is the generated one, every
"works" entry names a test that exists, and every refused callback and Tuner method is refused
when the run sets up its environment, before any process group or collective, with a message
naming it, why and what to do instead. One process each (data=1): the refusal does not depend on
the world size."""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import polyparallel as pp
from polyparallel.testing.surface import SurfaceError, check_table
from polyparallel_lightning import surface

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMESPACES = ["lightning.pytorch", "pytorch_lightning"]


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_entry_of_the_installed_lightning_is_classified(namespace: str) -> None:
    """Everything the installed Lightning lists is classified. On an older Lightning than the one
    classified (2.4 is supported) entries added since may be absent; on the classified one and
    newer, nothing classified may have gone."""
    module = pytest.importorskip(namespace)
    discovered = surface.discover(namespace)
    if _version(module.__version__) < _version(surface.SURFACE.version):
        discovered = {kind: sorted(set(names) | surface.SURFACE.names(kind)) for kind, names in discovered.items()}
        listed = {n for names in surface.discover(namespace).values() for n in names}
        assert listed <= surface.SURFACE.names(), sorted(listed - surface.SURFACE.names())
    surface.SURFACE.check_covers(discovered)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("+")[0].split(".")[:3] if p.isdigit())


def test_the_published_table_is_the_generated_one() -> None:
    check_table(surface.SURFACE, os.path.join(ROOT, "docs", "surface", "lightning.md"))


def test_every_works_entry_names_a_test_that_exists() -> None:
    surface.SURFACE.check_tests_exist(ROOT)


def _refused_callback(name: str, namespace: str, tmp: str) -> Any:
    callbacks = importlib.import_module(f"{namespace}.callbacks")
    made = {"ModelPruning": lambda c: c("l1_unstructured"), "OnExceptionCheckpoint": lambda c: c(tmp),
            "ThroughputMonitor": lambda c: c(batch_size_fn=len)}
    cls = getattr(callbacks, name)
    return made.get(name, lambda c: c())(cls)


def _module(namespace: str, ran: list[int]) -> Any:
    L = importlib.import_module(namespace)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)
            self.lr, self.batch_size = 0.1, 4

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ran.append(batch_idx)
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.lr)

        def train_dataloader(self) -> Any:
            return DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=self.batch_size)

    return Module()


def _trainer(namespace: str, tmp: str, callbacks: list[Any]) -> Any:
    L = importlib.import_module(namespace)
    checkpointing = any(isinstance(c, L.callbacks.Checkpoint) for c in callbacks)
    return L.Trainer(strategy=pp.Strategy(data=1).adapt("lightning", namespace=namespace), accelerator="cpu",
                     devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=checkpointing, max_epochs=1,
                     default_root_dir=tmp, callbacks=callbacks)


def _assert_message(message: str, name: str) -> None:
    entry = surface.SURFACE[name]
    assert entry.name in message and entry.reason in message and entry.instead in message, message


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("entry", [e for e in surface.SURFACE.entries if e.status == "refused" and e.kind == "callback"],
                         ids=lambda e: e.short)
def test_refused_callbacks_are_refused_before_anything_runs(entry: Any, namespace: str, tmp_path: Any) -> None:
    pytest.importorskip(namespace)
    ran: list[int] = []
    trainer = _trainer(namespace, str(tmp_path), [_refused_callback(entry.short, namespace, str(tmp_path))])
    with pytest.raises(SurfaceError) as info:
        trainer.fit(_module(namespace, ran))
    _assert_message(str(info.value), entry.name)
    assert ran == [], "training started before the refusal"


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_the_tuners_lr_find_is_refused_before_anything_runs(namespace: str, tmp_path: Any) -> None:
    """Fails on main: lr_find ran under the adapter, its suggestion made from global rank 0's
    share of each batch (broadcast), silently not one process's."""
    pytest.importorskip(namespace)
    tuner = importlib.import_module(f"{namespace}.tuner").Tuner
    ran: list[int] = []
    module = _module(namespace, ran)
    with pytest.raises(SurfaceError) as info:
        tuner(_trainer(namespace, str(tmp_path), [])).lr_find(module)
    _assert_message(str(info.value), "lightning.pytorch.tuner.tuning.Tuner.lr_find")
    assert ran == [] and module.lr == 0.1


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_the_tuners_scale_batch_size_is_refused_before_anything_runs(namespace: str, tmp_path: Any) -> None:
    """Lightning itself refuses it with a distributed strategy, at the call (the adapter's
    strategies are distributed at any size); the declared entry says what to do instead."""
    pytest.importorskip(namespace)
    tuner = importlib.import_module(f"{namespace}.tuner").Tuner
    ran: list[int] = []
    module = _module(namespace, ran)
    with pytest.raises(ValueError, match="not supported with distributed strategies"):
        tuner(_trainer(namespace, str(tmp_path), [])).scale_batch_size(module)
    assert ran == [] and module.batch_size == 4


def test_a_subclass_of_a_refused_callback_is_refused_and_one_of_callback_is_not(tmp_path: Any) -> None:
    from lightning.pytorch.callbacks import BackboneFinetuning, Callback

    class Mine(BackboneFinetuning):
        pass

    entry = surface.classify(Mine())
    assert entry is not None and entry.short == "BackboneFinetuning" and entry.status == "refused"
    entry = surface.classify(type("Own", (Callback,), {})())
    assert entry is not None and entry.short == "Callback" and entry.status == "works"
    surface.check_trainer(_trainer("lightning.pytorch", str(tmp_path), [type("Own", (Callback,), {})()]))


def test_predictions_are_merged_into_the_global_batches_in_order() -> None:
    """merge_predictions, the data ranks' batch outputs of predict (strided shards of 11 rows at
    data=2, batch 2 per rank: rank 0 has 3 batches, rank 1 has 3, its last of 1) -> one process's
    batches of 4, also for dicts and tuples; an output without a batch dimension is refused."""
    from polyparallel_lightning.predict import merge_predictions

    rows = torch.arange(11.0)
    shards = [rows[r::2] for r in range(2)]
    per_rank = [[{"x": s[k:k + 2], "pair": (s[k:k + 2] * 10, s[k:k + 2].long())} for k in range(0, len(s), 2)]
                for s in shards]
    merged = merge_predictions(per_rank)
    assert [m["x"].tolist() for m in merged] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert torch.equal(torch.cat([m["pair"][0] for m in merged]), rows * 10)
    assert all(isinstance(m["pair"], tuple) and m["pair"][1].dtype == torch.long for m in merged)
    three = merge_predictions([[rows[r::3][k:k + 2] for k in range(0, len(rows[r::3]), 2)] for r in range(3)])
    assert torch.equal(torch.cat(three), rows) and [len(b) for b in three] == [6, 5]
    with pytest.raises(TypeError, match="return_predictions=False"):
        merge_predictions([[torch.tensor(1.0)], [torch.tensor(2.0)]])
    with pytest.raises(TypeError, match="first dimension is the batch"):
        merge_predictions([[(torch.zeros(2), "label")], [(torch.zeros(2), "label")]])
