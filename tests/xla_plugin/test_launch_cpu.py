"""``pp.launch`` on PJRT CPU as a user runs it: ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=2`` and nothing
else, no test support in the function. The runtime applies what replica threads need itself
(``polyparallel_xla.cpu``, pytorch/xla issue 9089); before, XLA aborted the process ("Expected 2
threads to join the rendezvous, but only 1 of them arrived on time").

Each run is a fresh interpreter whose environment lacks the settings this lane's conftest puts in
``os.environ`` (``polyparallel_xla.testing.CPU_ENV``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch_xla")

from polyparallel_xla.cpu import CPU_ENV  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CPU_ENV and k != "XLA_FLAGS"}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2", OMP_NUM_THREADS="1")
    return env


def _run(argv: list[str], cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=380, env=_user_env(),
                          cwd=cwd)


def test_the_example_runs_on_two_xla_cpu_devices_without_any_workaround():
    done = _run([os.path.join(ROOT, "examples", "xla_train.py"), "--epochs", "1"], ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "last-epoch loss over 2 XLA devices: " in done.stdout
    assert "Termination timeout" not in done.stderr


FASTAI = textwrap.dedent("""
    import functools, json, os
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import polyparallel as pp

    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def train(strategy, state):
        from fastai.data.core import DataLoaders
        from fastai.learner import Learner
        from fastai.losses import CrossEntropyLossFlat
        from fastai.metrics import accuracy
        from fastai.optimizer import SGD

        g = torch.Generator().manual_seed(1)
        x = torch.randn(61, 8, generator=g)  # 61: no global batch divides it
        ds = TensorDataset(x, x[:, :3].argmax(-1))
        dls = DataLoaders.from_dsets(ds, ds, bs=16, shuffle=True, drop_last=True, num_workers=0, device="cpu")
        model = make_model()
        model.load_state_dict(state)  # weights from the parent: replica threads share the RNG
        learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=functools.partial(SGD, mom=0.9),
                        lr=0.05, metrics=[accuracy], cbs=strategy.adapt("fastai"))
        with learn.no_logging():
            learn.fit(2)
        return [list(map(float, v)) for v in learn.recorder.values]

    if __name__ == "__main__":
        strategy = pp.Strategy(data=-1, runtime="xla", batch_size=16, timeout=120, seed=0)
        results = pp.launch(train, strategy, nprocs=2, args=(strategy, make_model().state_dict()), timeout=360)
        print("RESULT " + json.dumps(results))
        print("PARENT_ENV " + json.dumps({k: os.environ.get(k) for k in ("XLA_NO_SPECIAL_SCALARS",)}))
""")


def test_a_fastai_learner_fits_on_two_xla_cpu_devices_without_any_workaround(tmp_path):
    pytest.importorskip("fastai")
    script = tmp_path / "fit.py"
    script.write_text(FASTAI)
    done = _run([str(script)], str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    results = json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])
    assert len(results) == 2 and results[0] == results[1] and len(results[0]) == 2  # 2 epochs, ranks agree
    # The parent's environment is left alone: only the replicas' process got the CPU settings.
    assert json.loads(next(line for line in lines if line.startswith("PARENT_ENV "))[11:]) == {
        "XLA_NO_SPECIAL_SCALARS": None}


def test_a_function_of_a_notebook_or_python_stdin_is_refused_before_any_replica(tmp_path):
    code = textwrap.dedent("""
        import polyparallel as pp

        def train():
            return 1

        try:
            pp.launch(train, pp.Strategy(data=-1, runtime="xla"), nprocs=2)
        except pp.LaunchError as exc:
            print("REFUSED", exc)
    """)
    done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=120,
                          env=_user_env(), cwd=str(tmp_path))
    assert "REFUSED launch(): train is defined in an interactive __main__" in done.stdout, done.stderr[-2000:]
    assert "the 'xla' runtime starts its replicas in a fresh interpreter" in done.stdout
    assert "Put the function (and what it uses) in a file" in done.stdout
