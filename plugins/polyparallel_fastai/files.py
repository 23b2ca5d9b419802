"""fastai's files written and read by the adapter: ``learn.save``/``load`` (fastai's model file)
and ``learn.export`` (a pickled Learner), without fastai's ``RANK`` checks — the session's roles
decide which rank writes (the replica threads of an XLA process share one environment)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from fastai.torch_core import to_detach

__all__ = ["export_learner", "load_model", "write_model"]


def _unwrapped(model: Any) -> Any:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


_LOAD_LOCK = threading.Lock()


def load_model(path: Path, model: Any, opt: Any, **options: Any) -> None:
    """fastai's ``load_model``, one thread at a time: it allowlists its classes for torch's
    ``weights_only`` unpickler with ``torch.serialization.safe_globals``, a process-wide set that
    the first thread to leave the context empties for the others (the replica threads of one XLA
    process load together)."""
    from fastai.learner import load_model as fastai_load_model

    with _LOAD_LOCK:
        fastai_load_model(path, model, opt, **options)


def write_model(path: Path, learn: Any, with_opt: bool, pickle_protocol: int) -> None:
    # fastai's save_model, without its `RANK` environment check (replica threads of an XLA
    # process share one environment; the session's roles decide who writes), on the CPU.
    from fastai.torch_core import get_model

    state: Any = get_model(_unwrapped(learn.model)).state_dict()
    opt = getattr(learn, "opt", None)
    if with_opt and opt is not None:
        state = {"model": state, "opt": opt.state_dict()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(to_detach(state, cpu=True, gather=False), path, pickle_protocol=pickle_protocol)


def export_learner(learn: Any, cb: Any, path: Path, pickle_module: Any, pickle_protocol: int) -> None:
    """fastai's ``Learner.export`` without its ``RANK`` check (the session's roles decide who
    writes) and without the adapter: the callback is detached while the Learner is pickled."""
    import warnings

    if pickle_module is None:
        import cloudpickle

        pickle_module = cloudpickle
    learn.remove_cb(cb)  # our Learner methods go with it
    try:
        learn._end_cleanup()
        old_dls, old_opt = learn.dls, learn.opt
        learn.dls, learn.opt = learn.dls.new_empty(), None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's warning about an unchecked model, as fastai
                torch.save(learn, path, pickle_module=pickle_module, pickle_protocol=pickle_protocol)
        finally:
            learn.dls, learn.opt = old_dls, old_opt
    finally:
        learn.add_cb(cb)
