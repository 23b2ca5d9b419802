"""``Strategy(accumulate=N)`` on fastai: its ``GradientAccumulation`` callback over micro-batches.

- ``strategy.shard_data`` of a fastai loader (:mod:`.data`) yields micro-batches:
  ``batch_size / (data x N)`` samples a rank (without a global batch size, the loader's ``bs``,
  per rank and optimizer step, divided by N).
- The Learner accumulates with fastai's ``GradientAccumulation(n_acc=<global batch>)``: the one
  the Learner carries when its ``n_acc`` is the Strategy's global batch (``n_acc`` counts
  samples), else one added for the fit and removed at its end. A ``GradientAccumulation`` with
  another ``n_acc`` is refused before any collective, naming both. fastai scales each
  micro-batch's loss by its share of the step's samples, so a step's gradient is the mean over
  its samples, as one large batch's; :mod:`.everyday` makes ``n_acc`` count the whole data group.
- One reduction per step: under DDP, the callback's ``before_batch`` switches the gradient
  all-reduce on for the last micro-batch of each step only (the runtime's
  ``set_gradient_sync``, what DDP's ``no_sync`` sets).

With ``Strategy(accumulate=1)`` a ``GradientAccumulation`` the Learner carries runs as before
(:mod:`.everyday`): its ``n_acc`` then sets the step, not the Strategy.
"""

from __future__ import annotations

from typing import Any

from fastai.callback.training import GradientAccumulation
from fastai.torch_core import find_bs

import polyparallel as pp

__all__ = ["StrategyGradientAccumulation", "apply", "last_of_step"]


class StrategyGradientAccumulation(GradientAccumulation):
    """fastai's ``GradientAccumulation`` that the adapter adds for one fit; removed from the
    Learner once the fit ends."""

    def after_fit(self) -> None:
        self.learn.remove_cb(self)


def apply(learn: Any, strategy: pp.Strategy, data: int) -> Any:
    """The ``GradientAccumulation`` of this fit under ``Strategy(accumulate=N > 1)`` (``None``
    for N = 1), at data size ``data``. Called from the adapter's ``before_fit`` before
    :func:`.everyday.adjust`."""
    steps = strategy.accumulate
    if steps == 1:
        return None
    loader_bs = getattr(getattr(learn.dls, "train", None), "bs", None)
    global_batch = strategy.data_policy.batch_size or (loader_bs * data if loader_bs else None)
    if global_batch is None:
        raise TypeError("Strategy(accumulate=) on fastai needs a batch size: Strategy(batch_size=) or the training "
                        "DataLoader's bs.")
    carried = [cb for cb in learn.cbs if isinstance(cb, GradientAccumulation)]
    for cb in carried:
        if cb.n_acc != global_batch:
            raise pp.TopologyError(
                f"the Learner's GradientAccumulation(n_acc={cb.n_acc}) contradicts Strategy(accumulate={steps}), whose "
                f"optimizer step is {global_batch} samples (micro-batch x accumulate x data = {global_batch // (steps * data)}"
                f" x {steps} x {data}). The accumulation belongs to the polyparallel Strategy: leave the callback out "
                f"(the adapter adds it), or give it n_acc={global_batch}.")
    if carried:
        return carried[0]
    added = StrategyGradientAccumulation(n_acc=global_batch)
    learn.add_cb(added)
    added.before_fit()  # added during before_fit: fastai will not call it for this event
    return added


def last_of_step(accumulation: Any, learn: Any) -> bool:
    """Whether the batch about to run completes an optimizer step (``GradientAccumulation``
    steps once its count of samples reaches ``n_acc``)."""
    return bool(accumulation.count + find_bs(learn.yb) >= accumulation.n_acc)
