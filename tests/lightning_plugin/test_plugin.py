"""The adapter without launching processes: registration, namespaces, refusals and their messages."""

import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel_lightning.namespaces import resolve_namespace


def _python(code, timeout=120):
    proc = subprocess.run(["timeout", "-k", "5", str(timeout), sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout + 15)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_plugin_import_and_registration_load_neither_torch_nor_lightning():
    out = _python("""
        import sys
        import polyparallel as pp
        adapters = pp.get_plugin_manager().adapters()
        caps = adapters["lightning"].capabilities
        print(sorted(caps.axes), adapters["lightning"].plugin,
              [m for m in ("torch", "lightning", "pytorch_lightning") if m in sys.modules])
    """)
    assert out.split("\n")[0] == "['data', 'tensor'] lightning []"


def test_adapt_without_lightning_names_the_extra():
    out = _python("""
        import sys
        for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "lightning_fabric"):
            sys.modules[name] = None  # as if not installed
        import polyparallel as pp
        for namespace in (None, "pytorch_lightning"):
            try:
                pp.Strategy(data=1).adapt("lightning", namespace=namespace)
            except ImportError as exc:
                print("ImportError:", exc)
    """)
    lines = [line for line in out.splitlines() if line.startswith("ImportError:")]
    assert len(lines) == 2
    assert all("pip install 'polyparallel[lightning]'" in line for line in lines)
    assert "neither `lightning` nor `pytorch_lightning`" in lines[0] and "'pytorch_lightning'" in lines[1]


def test_pipeline_is_refused_before_anything_starts():
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'lightning'.*cannot run pipeline=2.*Set pipeline=1"):
        pp.Strategy(data=1, pipeline=2).adapt("lightning")
    with pytest.raises(pp.UnsupportedTopologyError):
        pp.Strategy(data=1, pipeline=2).check("lightning")


def test_namespace_rule(monkeypatch):
    import lightning.pytorch  # noqa: F401 - both installed here
    import pytorch_lightning  # noqa: F401

    assert resolve_namespace("lightning").pytorch == "lightning.pytorch"
    assert resolve_namespace("pl").pytorch == "pytorch_lightning"
    with pytest.raises(ValueError, match=r"namespace=\.\.\.\) must be one of .* Received: 'torch'"):
        resolve_namespace("torch")
    with pytest.raises(ValueError, match="Both `lightning.pytorch` and `pytorch_lightning` are imported"):
        resolve_namespace()
    with pytest.raises(ValueError, match="namespace='pytorch_lightning'"):
        pp.Strategy(data=1).adapt("lightning")
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    assert resolve_namespace().pytorch == "pytorch_lightning"
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    assert resolve_namespace().pytorch == "lightning.pytorch"


@pytest.mark.parametrize("namespace, other", [("lightning.pytorch", "pytorch_lightning"),
                                              ("pytorch_lightning", "lightning.pytorch")])
def test_each_namespace_gets_its_own_classes_and_its_trainer_accepts_them(namespace, other):
    import importlib

    ns, other_ns = importlib.import_module(namespace), importlib.import_module(other)
    strategy = pp.Strategy(data=-1, timeout=30)
    adapter = strategy.adapt("lightning", namespace=namespace)
    assert isinstance(adapter, ns.strategies.DDPStrategy)
    assert not isinstance(adapter, other_ns.strategies.Strategy)
    assert type(strategy.adapt("lightning", namespace=namespace)) is type(adapter), "classes are cached"
    fabric = importlib.import_module("lightning.fabric" if namespace == "lightning.pytorch" else "lightning_fabric")
    assert isinstance(adapter.cluster_environment, fabric.plugins.environments.ClusterEnvironment)
    trainer = ns.Trainer(strategy=adapter, accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy is adapter and trainer._accelerator_connector.is_distributed
    with pytest.raises((ValueError, TypeError)):
        other_ns.Trainer(strategy=adapter, accelerator="cpu", devices=1, logger=False)
    again = pickle.loads(pickle.dumps(adapter))  # Lightning's spawn launcher pickles the Trainer
    assert type(again) is type(adapter) and again.polyparallel_strategy == strategy


def test_topology_that_does_not_fit_the_trainer_is_refused_at_construction(monkeypatch):
    import lightning.pytorch as L

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    adapter = pp.Strategy(data=2, tensor=2).adapt("lightning", namespace="lightning.pytorch")
    with pytest.raises(pp.TopologyError, match=r"cannot run on the 2 processes Trainer\(devices=2, num_nodes=1\) makes"):
        L.Trainer(strategy=adapter, accelerator="cpu", devices=2, logger=False)


def test_sync_batchnorm_with_tensor_replicas_is_refused_at_setup(monkeypatch):
    import lightning.pytorch as L

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    adapter = pp.Strategy(data=1, tensor=2).adapt("lightning", namespace="lightning.pytorch")
    trainer = L.Trainer(strategy=adapter, accelerator="cpu", devices=2, sync_batchnorm=True, logger=False)
    # The refusal is the first thing setup() does: no process is launched, no group is made.
    with pytest.raises(pp.UnsupportedTopologyError, match=r"sync_batchnorm=True\) .*tensor=2\)\. Use sync_batchnorm=False"):
        adapter.setup(trainer)
    assert torch.distributed.is_initialized() is False


def test_arguments_the_strategy_decides_are_refused():
    with pytest.raises(TypeError, match=r"timeout comes from Strategy\(timeout=...\)"):
        pp.Strategy(data=1).adapt("lightning", namespace="lightning.pytorch", timeout=5)
    with pytest.raises(TypeError, match="plan=\\) must be a dict or a callable"):
        pp.Strategy(data=1).adapt("lightning", namespace="lightning.pytorch", plan=[1, 2])


def test_external_launch_ranks_and_data_axis_sampler_kwargs(monkeypatch):
    adapter = pp.Strategy(data=2, tensor=2, seed=7).adapt("lightning", namespace="lightning.pytorch")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert not adapter.cluster_environment.creates_processes_externally
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert adapter.cluster_environment.creates_processes_externally
    adapter.cluster_environment.set_world_size(1)  # Lightning's guess from Trainer(devices=1)
    adapter.cluster_environment.set_global_rank(0)
    assert (adapter.world_size, adapter.global_rank) == (4, 3)
    # rank 3 = (data 1, tensor 1): its tensor replica rank 2 gets the same shard, rank 1 the other.
    assert adapter.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1, "seed": 7}
    assert adapter.is_distributed


def test_default_tensor_plan_is_the_runtimes_for_the_single_sequential_child(monkeypatch):
    import lightning.pytorch as L

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    adapter = pp.Strategy(data=1, tensor=2).adapt("lightning", namespace="lightning.pytorch")

    class Mlp(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    plan = adapter._tensor_plan(Mlp())
    assert {k: type(v).__name__ for k, v in plan.items()} == {"net.0": "ColwiseParallel", "net.2": "RowwiseParallel"}

    class TwoTowers(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))

    with pytest.raises(TypeError, match=r"exactly one nn.Sequential child, it has 2\. Pass strategy.adapt"):
        adapter._tensor_plan(TwoTowers())
    assert torch.distributed.is_initialized() is False  # nothing above needed a process group


# -- sharding stages ------------------------------------------------------------------------------------
def test_stages_are_the_torch_runtimes_and_an_undeclared_one_is_refused_before_anything_starts():
    from polyparallel_lightning.plugin import CAPABILITIES
    from polyparallel_torch.capabilities import CAPABILITIES as TORCH

    assert CAPABILITIES.stages == TORCH.stages and 0 in CAPABILITIES.stages
    assert pp.get_plugin_manager().adapters()["lightning"].capabilities.stages == TORCH.stages
    for stage in sorted({0, 1, 2, 3} - TORCH.stages):
        with pytest.raises(pp.UnsupportedTopologyError, match=rf"cannot run sharding stage zero={stage}: it runs"):
            pp.Strategy(data=2, zero=stage).adapt("lightning", namespace="lightning.pytorch")
        with pytest.raises(pp.UnsupportedTopologyError, match=rf"zero={stage}"):
            pp.Strategy(data=2, zero=stage).check("lightning")
    assert torch.distributed.is_initialized() is False


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_stage_picks_the_lightning_base_class_and_each_trainer_accepts_it(namespace, monkeypatch):
    import importlib

    from polyparallel_lightning.factory import make_strategy, strategy_class
    from polyparallel_lightning.namespaces import NAMESPACES

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    ns = importlib.import_module(namespace)
    assert issubclass(strategy_class(namespace, 0), ns.strategies.DDPStrategy)
    for stage in (1, 2, 3):
        assert issubclass(strategy_class(namespace, stage), ns.strategies.ModelParallelStrategy)
        assert not issubclass(strategy_class(namespace, stage), ns.strategies.DDPStrategy)
    # Built directly (what adapt() does once the runtime declares the stage): construction only.
    strategy = pp.Strategy(data=-1, zero=3, timeout=30)
    adapter = make_strategy(strategy, NAMESPACES[namespace])
    assert isinstance(adapter, ns.strategies.ModelParallelStrategy)
    trainer = ns.Trainer(strategy=adapter, accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy is adapter
    again = pickle.loads(pickle.dumps(adapter))  # Lightning's spawn launcher pickles the Trainer
    assert type(again) is type(adapter) and again.polyparallel_strategy == strategy
    with pytest.raises(TypeError, match=r"zero=3 takes plan= and save_distributed_checkpoint= only .*"
                                        r"\['find_unused_parameters'\].*apply at zero=0"):
        make_strategy(strategy, NAMESPACES[namespace], find_unused_parameters=True)
    with pytest.raises(TypeError, match=r"tensor_parallel_size comes from Strategy\(tensor=...\)"):
        make_strategy(strategy, NAMESPACES[namespace], tensor_parallel_size=2)
    with pytest.raises(TypeError, match=r"save_distributed_checkpoint=False\): the adapter always writes one "
                                        r"polyparallel checkpoint directory"):
        make_strategy(strategy, NAMESPACES[namespace], save_distributed_checkpoint=False)


def test_sharded_topology_that_does_not_fit_the_trainer_is_refused_at_construction(monkeypatch):
    import lightning.pytorch as L

    from polyparallel_lightning.factory import make_strategy
    from polyparallel_lightning.namespaces import NAMESPACES

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    adapter = make_strategy(pp.Strategy(data=4, zero=3), NAMESPACES["lightning.pytorch"])
    with pytest.raises(pp.TopologyError, match=r"cannot run on the 2 processes Trainer\(devices=2, num_nodes=1\) makes"):
        L.Trainer(strategy=adapter, accelerator="cpu", devices=2, logger=False)
    assert torch.distributed.is_initialized() is False


def test_a_step_runs_through_the_wrapped_modules_forward_and_forward_is_restored():
    import lightning.pytorch as L

    from polyparallel_lightning.sharded import _through_forward

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 1)

        def forward(self, x):
            return self.layer(x)

        def training_step(self, x, scale):
            return self(x).sum() * scale  # the real forward, from inside the step

    module, hooked = Module(), []
    module.register_forward_pre_hook(lambda mod, args, kwargs: hooked.append(args), with_kwargs=True)
    x = torch.ones(3, 2)
    out = _through_forward(module, module, "training_step", x, 2.0)
    assert torch.allclose(out, module.layer(x).sum() * 2.0)
    # The hook saw the step's arguments (FSDP2 gathers there), then the inner self(x) call.
    assert len(hooked) == 2 and hooked[0][1] == 2.0 and hooked[1][0] is x
    assert "forward" not in vars(module), "forward must be the class's again"
