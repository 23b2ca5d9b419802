"""``Strategy(accumulate=N)`` in the plain PyTorch loop: micro-batches, one reduction per step.

``strategy.shard_data`` gives micro-batches: ``micro = polyparallel.micro_batch_size(batch_size,
data, N)`` samples per rank (:func:`per_rank_batch`), so the global batch of one optimizer step
is ``micro x N x data``. Because :func:`polyparallel.shard_indices` gives data coordinate ``d``
the positions ``d, d + D, ...`` of the epoch's order, global micro-batch ``k`` of step ``i`` is
``order[i*B + k*B/N : i*B + (k+1)*B/N]`` at every data size: the same samples, in the same
micro-step, as any other runtime's.

:func:`steps` groups the loader's micro-batches into optimizer steps::

    for step in polyparallel_torch.steps(strategy, model, loader):   # one optimizer step each
        for x, y in step:                    # its micro-batches; the last one reduces
            step.backward(loss_fn(model(x), y))
        step.optimize(opt)                   # sync_grads, opt.step(), opt.zero_grad()

- **One reduction per step.** Before each micro-batch is handed out, the wrapper's gradient
  synchronisation is switched on for the step's last micro-batch only: DDP's
  ``require_backward_grad_sync`` (what ``DDP.no_sync`` sets: it must hold during forward, where
  DDP prepares its reducer), FSDP2's ``set_requires_gradient_sync`` (no reduce-scatter in the
  other backwards). A bare module (tensor parallel, a module the user did not wrap) needs
  nothing: its gradients add up in ``.grad`` and ``sync_grads`` reduces once, in
  :meth:`Step.optimize`. Every rank has the same number of micro-batches in every step (the
  shards are equally long unless ``remainder="uneven"``), so every rank runs the same collectives.
- **The same gradient as one large batch.** :meth:`Step.backward` scales each micro-batch's loss
  (a mean over its rows) by its share of the step's rows, so the accumulated gradient is the mean
  over the step's rows: with ``N`` full micro-batches ``1/N``; in a last, partial step the shorter
  micro-batches weigh less, as their rows would in one batch. The share uses this rank's rows,
  which are every rank's under ``remainder="pad"`` or ``"drop"``.
- The step prefetches its micro-batches (at most ``N`` of this rank's inputs) to know their rows.

A hand-written loop can do the same with :func:`polyparallel_torch.no_sync` (DDP and FSDP2)
around the forward and backward of all but the last micro-batch of a step, dividing each loss by
``N``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

import polyparallel as pp

__all__ = ["Step", "no_sync", "per_rank_batch", "set_gradient_sync", "steps"]


def per_rank_batch(global_batch: int | None, fallback: int | None, data_size: int, accumulate: int = 1) -> int | None:
    """What one rank's loader yields per micro-step: ``global_batch / (data x accumulate)``, or,
    without a global batch, the loader's own ``batch_size`` (per rank and optimizer step) divided
    by ``accumulate``."""
    if global_batch is None:
        if fallback is None or accumulate == 1:
            return fallback
        if fallback % accumulate:
            raise pp.TopologyError(
                f"the loader's batch_size {fallback} (per rank and optimizer step) does not divide into "
                f"accumulate={accumulate} micro-batches; use a multiple of {accumulate}, or give the global "
                "batch size (Strategy(batch_size=) or shard_data(loader, batch_size=)).")
        return fallback // accumulate
    try:
        return pp.micro_batch_size(global_batch, data_size, accumulate)
    except ValueError as exc:
        raise pp.TopologyError(str(exc)) from None


def _ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def _fsdp(model: nn.Module) -> bool:
    from .sharding import is_fsdp

    return is_fsdp(model)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Switch the gradient reduction in ``model``'s backward on or off (DDP, FSDP2; a bare
    module reduces only in ``sync_grads``, so there is nothing to switch)."""
    if _ddp(model):
        model.require_backward_grad_sync = enabled  # type: ignore[assignment]
    elif _fsdp(model):
        model.set_requires_gradient_sync(enabled)  # type: ignore[operator]


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients without reducing them: DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync(False)``; a no-op for a bare module (reduced only by
    ``strategy.sync_grads``). Put the forward and backward of a step's earlier micro-batches in it."""
    if _ddp(model):
        with model.no_sync():  # type: ignore[operator]
            yield
    elif _fsdp(model):
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
    else:
        yield


def _rows(batch: Any) -> int:
    """The rows of a micro-batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values: Iterable[Any] = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        rows = _rows(value)
        if rows >= 0:
            return rows
    return -1


class Step:
    """One optimizer step of :func:`steps`: its micro-batches (iterate them), :meth:`backward`
    for each micro-batch's loss and :meth:`optimize` at the end."""

    def __init__(self, strategy: pp.Strategy, model: nn.Module, batches: list[Any], index: int,
                 scaler: Any = None):
        self.strategy, self.model, self.batches, self.index = strategy, model, batches, index
        self.scaler = scaler
        rows = [_rows(b) for b in batches]
        # A batch without tensors (rows unknown): equal shares.
        self.rows = rows if all(r > 0 for r in rows) else [1] * len(batches)
        self.total = sum(self.rows)
        self._current: int | None = None
        self._backwards = 0

    @property
    def accumulate(self) -> int:
        """Micro-batches per step (``Strategy(accumulate=)``); the last step may have fewer."""
        return self.strategy.accumulate

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        last = len(self.batches) - 1
        try:
            for k, batch in enumerate(self.batches):
                self._current = k
                set_gradient_sync(self.model, k == last)  # the wrapper reduces in the last backward only
                yield batch
        finally:
            set_gradient_sync(self.model, True)
            self._current = None

    def weight(self) -> float:
        """The current micro-batch's share of the step's rows (``1/N`` for full micro-batches)."""
        if self._current is None:
            raise RuntimeError("Step.weight()/backward() is for the micro-batch being iterated: call it inside "
                               "`for batch in step:`.")
        return self.rows[self._current] / self.total

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for the current micro-batch, ``loss`` (its mean over the
        micro-batch) scaled by the micro-batch's share of the step's rows (and by the loss scale
        of a gradient scaler, under fp16), so the step's gradient is the mean over all its rows."""
        scaled = loss * self.weight()
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        self._backwards += 1

    def optimize(self, optimizer: torch.optim.Optimizer, zero_grad: bool = True) -> None:
        """End the step: ``strategy.sync_grads(model)`` (the one reduction of a bare module; a
        no-op under DDP and FSDP2, which reduced in the last backward), then ``optimizer.step()``
        (through the gradient scaler under fp16) and ``optimizer.zero_grad()``."""
        if self._backwards != len(self.batches):
            raise RuntimeError(
                f"step {self.index} ran Step.backward {self._backwards} time(s) for {len(self.batches)} "
                "micro-batch(es); call step.backward(loss) once per micro-batch (it scales the loss and lets the "
                "last one reduce), so that every rank runs the same reductions.")
        self.strategy.sync_grads(self.model)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        if zero_grad:
            optimizer.zero_grad()


def steps(strategy: pp.Strategy, model: nn.Module, loader: Iterable[Any], scaler: Any = None) -> Iterator[Step]:
    """The optimizer steps of one pass over ``loader`` (``strategy.shard_data``'s micro-batches):
    each a :class:`Step` of ``strategy.accumulate`` micro-batches (the last may have fewer).

    :param model: the module returned by ``strategy.wrap_model`` (DDP, FSDP2 or bare).
    :param scaler: a gradient scaler to use instead of the one the precision makes (fp16).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"polyparallel_torch.steps() needs the module returned by strategy.wrap_model. "
                        f"Received: {model!r}.")
    if scaler is None:
        from .precision import grad_scaler

        scaler = grad_scaler(model)
    n = strategy.accumulate
    iterator = iter(loader)
    index = 0
    while True:
        batches = []
        for batch in iterator:
            batches.append(batch)
            if len(batches) == n:
                break
        if not batches:
            return
        yield Step(strategy, model, batches, index, scaler)
        index += 1
