"""Scenarios of Lightning's everyday surface, each run twice: under the adapter (launched, data=2,
each loader's ``batch_size`` the rank's share) and in one process with a plain Trainer (no
polyparallel) and the global batch. float64 throughout, so results agree to rounding. Each
scenario returns its results and ``ran``: the surface entries it exercised (checked against the
declared "works" entries of the test that names it)."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

GLOBAL = 6  # the global batch: 3 per data rank at data=2
N_TRAIN, N_EVAL = 24, 23  # evaluation: shards of 12 and 11
C = "lightning.pytorch.callbacks."
T = "lightning.pytorch.trainer.trainer.Trainer."


DATA, SEED = 2, 5  # the launched run's Strategy(data=2, seed=5)


class GlobalOrder(Sampler):
    """The one-process reference's training order: Lightning shuffles every distributed training
    loader, and the adapter's shuffle is ``pp.shard_indices(seed=, epoch=)`` per data rank; global
    batch ``k`` is every rank's batch ``k``. Lightning calls ``set_epoch`` as on the adapter's."""

    def __init__(self, n: int, per_rank: int):
        self.n, self.per_rank, self.epoch = n, per_rank, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        import polyparallel as pp

        shards = [pp.shard_indices(self.n, r, DATA, seed=SEED, epoch=self.epoch, shuffle=True, remainder="pad")
                  for r in range(DATA)]
        for k in range(0, len(shards[0]), self.per_rank):
            for shard in shards:
                yield from shard[k:k + self.per_rank]


class Rows(Dataset):
    """(index, x, y) rows, float64, from a fixed seed."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, generator=g, dtype=torch.float64)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1 * torch.randn(
            n, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def _classes(ns: str) -> tuple[Any, Any]:
    L = importlib.import_module(ns)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(3, 1)

        def _loss(self, batch: Any) -> torch.Tensor:
            _, x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self._loss(batch)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            n = len(batch[0])
            self.log("val_loss", self._loss(batch), sync_dist=True, batch_size=n)
            self.log("val_rows", torch.tensor(float(n), dtype=torch.float64), reduce_fx="sum", sync_dist=True,
                     batch_size=n)
            self.log("val_max", batch[2].max(), reduce_fx="max", sync_dist=True, batch_size=n)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            n = len(batch[0])
            self.log("test_loss", self._loss(batch), sync_dist=True, batch_size=n)
            self.log("test_rows", torch.tensor(float(n), dtype=torch.float64), reduce_fx="sum", sync_dist=True,
                     batch_size=n)

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            index, x, _ = batch
            return {"index": index, "pred": self.lin(x).squeeze(-1)}

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Data(L.LightningDataModule):
        def __init__(self, batch: int) -> None:
            super().__init__()
            self.batch = batch

        def train_dataloader(self) -> Any:
            return train_loader(self.batch)

        def val_dataloader(self) -> Any:
            return DataLoader(Rows(N_EVAL, 2), batch_size=self.batch)

    return Module, Data


def train_loader(batch: int) -> DataLoader:
    """Training rows: the rank's share of each batch under the adapter (Lightning shuffles it), the
    global batch in the adapter's global order in one process."""
    if batch == GLOBAL:
        return DataLoader(Rows(N_TRAIN, 1), batch_size=GLOBAL, sampler=GlobalOrder(N_TRAIN, GLOBAL // DATA))
    return DataLoader(Rows(N_TRAIN, 1), batch_size=batch)


def _params(module: Any) -> list[float]:
    return [float(v) for p in module.lin.parameters() for v in p.detach().reshape(-1)]


class Context:
    """One run's Trainer factory: under the adapter (``strategy``) or plain, one process."""

    def __init__(self, ns: str, strategy: Any, directory: str):
        self.ns, self.strategy, self.directory = ns, strategy, directory
        self.L = importlib.import_module(ns)
        self.batch = GLOBAL // (strategy.topology.size("data") if strategy is not None else 1)
        self.Module, self.Data = _classes(ns)

    def trainer(self, **kwargs: Any) -> Any:
        options: dict[str, Any] = dict(accelerator="cpu", logger=False, enable_checkpointing=False,
                                       enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                       precision="64-true", default_root_dir=self.directory)
        if self.strategy is not None:
            options.update(strategy=self.strategy.adapt("lightning", namespace=self.ns),
                           devices=self.strategy.world_size)
        else:
            options.update(devices=1)
        options.update(kwargs)
        return self.L.Trainer(**options)

    def loader(self, n: int, seed: int) -> DataLoader:
        return DataLoader(Rows(n, seed), batch_size=self.batch)


def train(cx: Context) -> dict[str, Any]:
    """fit with a LightningDataModule and the training callbacks, one fit per weight-averaging one."""
    cb = cx.L.callbacks
    out: dict[str, Any] = {}
    epochs: list[int] = []
    hooks: list[int] = []

    class Own(cb.Callback):
        def on_validation_end(self, trainer: Any, module: Any) -> None:
            hooks.append(int(trainer.current_epoch))

    checkpoint = cb.ModelCheckpoint(dirpath=os.path.join(cx.directory, "best"), monitor="val_loss", save_top_k=1,
                                    filename="{epoch}")
    stopping = cb.EarlyStopping(monitor="val_loss", min_delta=0.05, patience=1)
    trainer = cx.trainer(max_epochs=30, enable_checkpointing=True, callbacks=[
        checkpoint, stopping, Own(), cb.LambdaCallback(on_train_epoch_end=lambda t, m: epochs.append(t.current_epoch)),
        cb.GradientAccumulationScheduler({0: 1, 2: 2})])
    with trainer.init_module():
        module = cx.Module()
    trainer.fit(module, datamodule=cx.Data(cx.batch))
    out["early"] = {"params": _params(module), "epochs": epochs, "hooks": hooks, "stopped": stopping.stopped_epoch,
                    "best_score": float(checkpoint.best_model_score), "val_loss": float(trainer.callback_metrics["val_loss"]),
                    "best": os.path.basename(checkpoint.best_model_path), "step": trainer.global_step}
    averaging = {"StochasticWeightAveraging": lambda: cb.StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1),
                 "WeightAveraging": lambda: cb.WeightAveraging(),
                 "EMAWeightAveraging": lambda: cb.EMAWeightAveraging(decay=0.7)}
    for name, make in averaging.items():
        module = cx.Module()
        cx.trainer(max_epochs=3, limit_val_batches=0, callbacks=[make()]).fit(
            module, train_loader(cx.batch))
        out[name] = {"params": _params(module)}
    out["ran"] = [C + n for n in ("Callback", "LambdaCallback", "EarlyStopping", "ModelCheckpoint", "Checkpoint",
                                  "GradientAccumulationScheduler", *averaging)] + [
        T + "fit", T + "init_module", "LightningDataModule"]
    return out


def evaluate(cx: Context) -> dict[str, Any]:
    """validate and test on 23 rows, the module's metrics logged with sync_dist=True."""
    module = cx.Module()
    trainer = cx.trainer()
    validated = trainer.validate(module, cx.loader(N_EVAL, 2), verbose=False)[0]
    tested = cx.trainer().test(module, cx.loader(N_EVAL, 3), verbose=False)[0]
    return {"validate": {k: float(v) for k, v in validated.items()}, "test": {k: float(v) for k, v in tested.items()},
            "ran": [T + "validate", T + "test", "LightningModule.log(sync_dist=True)"]}


def predict(cx: Context) -> dict[str, Any]:
    """predict on 23 rows (returned, in order), and a BasePredictionWriter's rows per rank."""
    written: list[tuple[list[int], list[float]]] = []

    class Writer(cx.L.callbacks.BasePredictionWriter):
        def write_on_batch_end(self, trainer: Any, module: Any, prediction: Any, batch_indices: Any, batch: Any,
                               batch_idx: int, dataloader_idx: int) -> None:
            written.append((list(batch_indices), prediction["pred"].tolist()))

    module = cx.Module()
    batches = cx.trainer().predict(module, cx.loader(N_EVAL, 2))
    cx.trainer(callbacks=[Writer("batch")]).predict(module, cx.loader(N_EVAL, 2), return_predictions=False)
    return {"batches": [{"index": b["index"].tolist(), "pred": b["pred"].tolist()} for b in batches],
            "written": written, "ran": [T + "predict", C + "BasePredictionWriter"]}


def shown(cx: Context) -> dict[str, Any]:
    """Progress bars, summaries, the learning-rate monitor with a CSV logger, Trainer.print, Timer:
    what each rank printed and wrote."""
    cb = cx.L.callbacks
    loggers = importlib.import_module(f"{cx.ns}.loggers")
    out: dict[str, Any] = {}
    text = io.StringIO()
    logs = os.path.join(cx.directory, "logs")
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        for bar, summary in ((cb.TQDMProgressBar(), cb.ModelSummary()), (cb.RichProgressBar(), cb.RichModelSummary())):
            trainer = cx.trainer(max_epochs=1, limit_val_batches=0, enable_progress_bar=True, enable_model_summary=True,
                                 logger=loggers.CSVLogger(logs), log_every_n_steps=1,
                                 callbacks=[bar, summary, cb.LearningRateMonitor()])
            trainer.fit(cx.Module(), train_loader(cx.batch))
            trainer.print("printed once")
        timer = cb.Timer(duration=timedelta(microseconds=1))
        trainer = cx.trainer(max_epochs=5, limit_val_batches=0, callbacks=[timer])
        trainer.fit(cx.Module(), train_loader(cx.batch))
    out["printed"] = text.getvalue()
    out["timer_step"] = trainer.global_step
    out["logs"] = sorted(os.listdir(os.path.join(logs, "lightning_logs"))) if os.path.isdir(logs) else []
    out["ran"] = [C + n for n in ("ProgressBar", "TQDMProgressBar", "RichProgressBar", "ModelSummary",
                                  "RichModelSummary", "LearningRateMonitor", "Timer")] + [T + "print"]
    return out


SCENARIOS = {"train": train, "evaluate": evaluate, "predict": predict, "shown": shown}


def run(ns: str, names: list[str], directory: str, strategy: Any = None) -> dict[str, Any]:
    """The scenarios ``names`` in this process (``strategy``: under the adapter; None: plain)."""
    out: dict[str, Any] = {}
    for name in names:
        where = os.path.join(directory, name)
        os.makedirs(where, exist_ok=True)
        out[name] = SCENARIOS[name](Context(ns, strategy, where))
    return out


def worker(strategy: Any, ns: str, names: list[str], directory: str) -> dict[str, Any]:
    """A launched rank: every scenario under the adapter (all ranks share ``directory``)."""
    return {"rank": strategy.rank, **run(ns, names, directory, strategy)}
