"""Ignite engines that step a DeepSpeed engine: what ``strategy.adapt("ignite")``'s
``create_supervised_trainer`` / ``create_supervised_evaluator`` build when handed an engine from
``strategy.adapt("deepspeed")``.

- Without a pipeline, one ignite iteration is one micro-batch: ``engine(x)``, the loss,
  ``engine.backward(loss)``, ``engine.step()`` (DeepSpeed steps the optimizer every
  ``gradient_accumulation_steps`` micro-batches). The output is the loss.
- With ``pipeline > 1``, one ignite iteration is one optimizer step: the batch (this data
  replica's share of the global batch) is cut into ``gradient_accumulation_steps`` micro-batches
  for ``engine.train_batch``. Every stage gets the same batch (``shard_data`` gives pipeline
  replicas identical batches); DeepSpeed broadcasts the loss, so the output is the loss on every
  stage. Evaluation runs ``engine.eval_batch`` with the logits returned on the last stage (the
  other stages output ``None`` and hold no metrics). DeepSpeed's ``eval_batch`` ends with a
  barrier over all ranks, so every data replica must run the same number of evaluation batches
  (true of ``remainder="uneven"`` shards whose sizes round up to the same count, and always of
  ``"pad"``/``"drop"``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["create_evaluator", "create_trainer"]


def _is_pipeline(engine: Any) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


def _microbatches(x: torch.Tensor, y: torch.Tensor, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if len(x) % count:
        raise ValueError(f"A batch of {len(x)} samples does not split into gradient_accumulation_steps={count} "
                         "micro-batches: give the loader the global batch size the engine was built with.")
    return list(zip(x.chunk(count), y.chunk(count)))


def create_trainer(engine: Any, loss_fn: Callable[..., torch.Tensor] | None, device: torch.device,
                   prepare_batch: Callable[..., Any] | None = None, non_blocking: bool = False,
                   output_transform: Callable[..., Any] | None = None) -> Any:
    """An ignite ``Engine`` whose iteration trains ``engine`` (a DeepSpeed engine) on one batch."""
    from ignite.engine import Engine, _prepare_batch

    prepare: Callable[..., Any] = prepare_batch or _prepare_batch
    pipeline = _is_pipeline(engine)
    if not pipeline and loss_fn is None:
        raise TypeError("create_supervised_trainer(deepspeed_engine, optimizer, loss_fn) needs loss_fn.")

    def step(_: Any, batch: Any) -> Any:
        x, y = prepare(batch, device=device, non_blocking=non_blocking)
        if pipeline:
            loss = engine.train_batch(iter(_microbatches(x, y, engine.gradient_accumulation_steps())))
        else:
            engine.train()
            loss = loss_fn(engine(x), y)  # type: ignore[misc]
            engine.backward(loss)
            engine.step()
        return output_transform(x, y, loss) if output_transform else loss.item()

    return Engine(step)


def create_evaluator(engine: Any, metrics: Mapping[str, Any], device: torch.device,
                     prepare_batch: Callable[..., Any] | None = None, non_blocking: bool = False,
                     output_transform: Callable[..., Any] | None = None) -> Any:
    """An ignite ``Engine`` evaluating ``engine``; ``metrics`` are attached to it (give them only
    on ranks that hold outputs: the ignite adapter does)."""
    from ignite.engine import Engine, _prepare_batch

    prepare: Callable[..., Any] = prepare_batch or _prepare_batch
    transform = output_transform or (lambda x, y, y_pred: (y_pred, y))
    pipeline = _is_pipeline(engine)

    def step(_: Any, batch: Any) -> Any:
        x, y = prepare(batch, device=device, non_blocking=non_blocking)
        if pipeline:
            # compute_loss stays on: without it DeepSpeed sums the logits of successive batches
            # into one buffer, which fails when an uneven shard's last batch is shorter.
            _, y_pred = engine.eval_batch(iter([(x, y)]), return_logits=True, bcast_loss=False, num_micro_batches=1)
            if not engine.is_last_stage():
                return None
        else:
            engine.eval()
            with torch.no_grad():
                y_pred = engine(x)
        return transform(x, y, y_pred)

    evaluator = Engine(step)
    for name, metric in metrics.items():
        metric.attach(evaluator, name)
    return evaluator
