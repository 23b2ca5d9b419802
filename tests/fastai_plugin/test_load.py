"""``learn.load`` from several threads of one process (the replica threads of an XLA process)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

pytest.importorskip("fastai")

import torch  # noqa: E402
from fastai.learner import save_model  # noqa: E402
from fastai.optimizer import SGD  # noqa: E402
from torch import nn  # noqa: E402

from polyparallel_fastai.files import load_model as _load_model  # noqa: E402


def test_two_threads_load_a_checkpoint_with_optimizer_state_at_once(tmp_path: Path, monkeypatch) -> None:
    """fastai's load_model allowlists fastcore's ``L`` (in the optimizer state) inside torch's
    process-wide ``safe_globals``; a second thread leaving that context while the first is still
    unpickling took ``L`` away from it (seen in the XLA lane). The test makes that interleaving
    happen: the first thread's unpickling waits (up to 2 s) for the second to finish."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = SGD(list(model.parameters()), lr=0.1, mom=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # momentum state: the saved optimizer state holds fastcore `L`s
    path = tmp_path / "ckpt.pth"
    save_model(path, model, opt)

    real_load = torch.load
    first_inside, second_done = threading.Event(), threading.Event()

    def ordered_load(*args, **kwargs):
        if threading.current_thread().name == "first":
            first_inside.set()  # inside fastai's safe_globals context
            second_done.wait(timeout=2.0)  # with the lock the second thread cannot run meanwhile
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", ordered_load)
    errors: list[BaseException] = []

    def load(name: str) -> None:
        try:
            target = nn.Linear(3, 2)
            target_opt = SGD(list(target.parameters()), lr=0.1, mom=0.9)
            _load_model(path, target, target_opt, with_opt=True, device="cpu", strict=True)
            assert torch.equal(target.weight, model.weight)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            if name == "second":
                second_done.set()

    threads = [threading.Thread(target=load, args=(n,), name=n) for n in ("first", "second")]
    threads[0].start()
    assert first_inside.wait(timeout=30)
    threads[1].start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
