"""A Lightning Trainer built inside a function ``pp.launch`` runs from an interactive session
(a notebook cell, ``python -i``): Lightning refuses a strategy whose launcher cannot run in an
interactive environment, but the processes already exist there, so the adapter launches nothing.

(The Lightning notebook itself runs through a real Jupyter kernel in
``tests/torch_plugin/test_notebooks.py``.)
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

SCRIPT = """
    import json, sys
    import polyparallel as pp

    def train(strategy, namespace):
        import importlib
        import torch
        from torch import nn
        L = importlib.import_module(namespace)
        fabric = "lightning.fabric" if namespace == "lightning.pytorch" else "lightning_fabric"
        fabric_interactive = importlib.import_module(f"{fabric}.utilities.imports")._IS_INTERACTIVE

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.net = nn.Linear(4, 1)

            def training_step(self, batch, _):
                x, y = batch
                return nn.functional.mse_loss(self.net(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        g = torch.Generator().manual_seed(1)
        x = torch.randn(37, 4, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        trainer = L.Trainer(strategy=strategy.adapt("lightning"), accelerator="cpu", devices=strategy.world_size,
                            max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        model = Module()
        trainer.fit(model, loader)
        return {"rank": strategy.rank, "interactive": bool(sys.flags.interactive) and fabric_interactive,
                "steps": trainer.global_step, "weight": model.net.weight.detach().sum().item()}

    strategy = pp.Strategy(data=-1, timeout=60)
    results = pp.launch(train, strategy, nprocs=2, args=(strategy, NAMESPACE), timeout=180)
    print("RESULT " + json.dumps(results))
"""


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_a_trainer_built_in_a_function_launched_from_an_interactive_session_fits(tmp_path, namespace):
    pytest.importorskip(namespace)
    path = tmp_path / "cell.py"
    path.write_text(textwrap.dedent(SCRIPT).replace("NAMESPACE", repr(namespace)))
    # `python -i -c`: an interactive interpreter (sys.flags.interactive, as Lightning checks) whose
    # __main__ has no file, as a notebook's: `train` lives there and pp.launch forks.
    out = subprocess.run([sys.executable, "-i", "-c", f"exec(open({str(path)!r}).read())"], input="",
                         capture_output=True, text=True, timeout=200, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         cwd=tmp_path)
    # An interactive interpreter goes on after an error (exit code 0): the RESULT line tells.
    assert out.returncode == 0 and "RESULT " in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if "RESULT " in line)
    results = json.loads(line.split("RESULT ", 1)[1])
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["interactive"] for r in results)  # Lightning saw an interactive environment
    assert results[0]["steps"] == results[1]["steps"] > 0
    assert results[0]["weight"] == results[1]["weight"]  # one model: the gradients were averaged
