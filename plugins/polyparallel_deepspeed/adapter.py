"""The DeepSpeed adapter: ``strategy.adapt("deepspeed", model=..., optimizer=..., config=...)``.

It returns what ``deepspeed.initialize`` returns first: the engine. In order, on every rank:

1. **Refuse before anything starts** (no process group, no collective): pipeline > 1 with ZeRO
   2/3 (DeepSpeed's own reason), a config that contradicts the Strategy (ZeRO stage, batch sizes:
   the error names both), a config key or option the declared surface refuses (:mod:`.surface`),
   an optimizer (or LR scheduler) given both in the config and as an argument (DeepSpeed would
   silently use the argument), at ZeRO-3 a parameter dtype ZeRO-3 cannot hold (below), a model
   that does not fit the topology, a launcher that did not set ``LOCAL_RANK``, and a machine
   where DeepSpeed would need to compile its CPU communication op without a C++ compiler (below).
2. **The Strategy's process groups**: the torch runtime's default group and DeviceMesh, made with
   the Strategy's timeout; an :class:`~polyparallel_deepspeed.mpu.TopologyMpu` hands DeepSpeed
   the data group and a one-rank model-parallel group.
3. ``pipeline > 1``: a ``deepspeed.pipe.PipelineModule`` partitioned from the ``nn.Sequential``
   (or list of layers) given, over a ``ProcessTopology(["pipe", "data"])`` laid out as the
   Strategy's topology (pipeline outermost), so stage ``s``, data coordinate ``d`` is the same
   rank in both. DeepSpeed's pipeline grid makes its own groups from it (it takes no ``mpu``);
   the adapter checks they hold the ranks of the Strategy's groups. ``dynamic_shape=True``, so
   evaluation batches of any size (an uneven shard's short last batch) run.
4. ``deepspeed.initialize(model, optimizer, config=build_config(...), mpu=...)``.

**Parameter dtypes at ZeRO-3.** DeepSpeed converts the module with ``zero.Init(dtype=<the first
parameter's dtype>)``, which asserts the dtype is float32, float16 or bfloat16; given no dtype it
would infer float16 wherever the accelerator reports fp16 support (a CPU with AVX512-FP16/AMX
does), so whether a model runs would depend on the machine. The adapter refuses any other
floating dtype (float64) at ZeRO-3 before anything starts, naming it, on every machine alike.

**The CPU communication op.** DeepSpeed's torch backend loads a shared-memory op
(``deepspeed_shm_comm``) when it first wraps the process group, compiling it with the C++
compiler on first use (~45-80 s here) into ``TORCH_EXTENSIONS_DIR`` (``tools/env.sh`` and the
tests point it at the project's ``.torch_extensions/``; the adapter never sets it). Without a C++
compiler that build fails inside ``deepspeed.initialize``, so the adapter refuses first, naming
the fixes: install one (``apt-get install g++``), or install DeepSpeed with the op prebuilt
(``DS_BUILD_SHM_COMM=1 pip install deepspeed``). The compiler is ``$CXX`` or ``c++``, as torch
looks for it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import polyparallel as pp

from .config import build_config

__all__ = ["DeepSpeedSetupError", "engine_states", "initialize", "shm_op_available"]

SHM_OP = "deepspeed_shm_comm"


class DeepSpeedSetupError(pp.PolyparallelError, RuntimeError):
    """DeepSpeed cannot start on this machine or launcher (refused before any collective)."""


def shm_op_available() -> str | None:
    """``None`` when DeepSpeed's CPU communication op can be loaded (prebuilt, already loaded,
    or a C++ compiler is there to build it); else why not."""
    from deepspeed import comm as ds_comm
    from deepspeed.git_version_info import installed_ops

    if ds_comm.is_initialized() or installed_ops.get(SHM_OP, False):
        return None
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is not None:
        return None
    return (f"DeepSpeed compiles its CPU communication op ({SHM_OP}) on first use, and no C++ compiler was found "
            f"(looked for {compiler!r}: $CXX, else c++). Install one (e.g. apt-get install g++), or install DeepSpeed "
            "with the op prebuilt: DS_BUILD_SHM_COMM=1 pip install deepspeed.")


def _check_model(model: Any, pipeline: int) -> None:
    if pipeline == 1:
        if not isinstance(model, nn.Module):
            raise TypeError(f"adapt('deepspeed', model=) must be a torch nn.Module. Received: {type(model).__name__}.")
        return
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule):
        raise TypeError("adapt('deepspeed') builds the PipelineModule from the Strategy's topology: pass the "
                        "nn.Sequential (or the list of layers) it is made of, and loss_fn=.")
    layers = list(model) if isinstance(model, (nn.Sequential, list, tuple)) else None
    if layers is None:
        raise TypeError(f"With pipeline={pipeline}, adapt('deepspeed', model=) must be an nn.Sequential or a list of "
                        f"layers to partition into stages. Received: {type(model).__name__}.")
    if len(layers) < pipeline:
        raise pp.TopologyError(f"pipeline={pipeline} needs at least {pipeline} layers to partition; the model has "
                               f"{len(layers)}.")


#: What DeepSpeed's ZeRO-3 (``zero.Init``) holds.
ZERO3_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_dtypes(model: Any, stage: int) -> None:
    if stage != 3:
        return
    named = model.named_parameters() if isinstance(model, nn.Module) else (
        (f"{i}.{n}", p) for i, layer in enumerate(model) if isinstance(layer, nn.Module) for n, p in layer.named_parameters())
    for name, param in named:
        if param.is_floating_point() and param.dtype not in ZERO3_DTYPES:
            raise TypeError(f"ZeRO-3 holds parameters of dtype {', '.join(map(str, ZERO3_DTYPES))} (DeepSpeed's zero.Init "
                            f"asserts it); the model's {name!r} is {param.dtype}. Convert the model (model.float()), or "
                            "use Strategy(zero=0, 1 or 2).")


def _check_both(optimizer: Any, lr_scheduler: Any, ds_config: dict[str, Any]) -> None:
    # DeepSpeed prefers the argument silently (engine._configure_optimizer / _configure_lr_scheduler).
    for name, given, key in (("optimizer", optimizer, "optimizer"), ("lr_scheduler", lr_scheduler, "scheduler")):
        if given is not None and key in ds_config:
            raise TypeError(f"adapt('deepspeed') got an {name} twice: {name}={type(given).__name__} and the config's "
                            f"{key!r} entry {ds_config[key]!r}; DeepSpeed would silently use the argument. Give one of "
                            "them.")


def _pipeline_module(model: Any, session: pp.Session, loss_fn: Callable[..., torch.Tensor] | None,
                     partition_method: str, options: dict[str, Any]) -> Any:
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import ProcessTopology

    topology = session.topology
    # Axes in the Strategy's nesting order (pipeline outermost): the same rank -> coords map.
    grid = ProcessTopology(axes=["pipe", "data"], dims=[topology.size("pipeline"), topology.size("data")])
    module = PipelineModule(layers=list(model), topology=grid, loss_fn=loss_fn, partition_method=partition_method,
                            dynamic_shape=True, **options)
    made = (sorted(module._grid.dp_group), sorted(module._grid.pp_group))
    wanted = (topology.group_of(session.rank, "data"), topology.group_of(session.rank, "pipeline"))
    if made != wanted:  # a DeepSpeed release with another layout: refuse rather than mix replicas
        raise pp.TopologyError(f"DeepSpeed's pipeline grid put rank {session.rank} in data/pipe groups {made}, "
                               f"but the Strategy's topology has {wanted}.")
    return module


def _keep_stage_params(optimizer: torch.optim.Optimizer, stage: nn.Module) -> None:
    # The optimizer was made over the whole model; this rank holds one stage. ZeRO partitions
    # what the optimizer holds, so it must hold only this stage's parameters (in place: the
    # user's object, with its hyper-parameters; param groups left empty are dropped).
    local = {id(p) for p in stage.parameters()}
    if optimizer.state:
        raise TypeError("With pipeline > 1, give adapt('deepspeed') a fresh optimizer (no state yet): it keeps only "
                        "the parameters of this rank's stage.")
    groups = []
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in local]
        if group["params"]:
            groups.append(group)
    optimizer.param_groups[:] = groups


def initialize(strategy: pp.Strategy, model: Any = None, optimizer: Any = None, config: dict[str, Any] | None = None,
               *, loss_fn: Callable[..., torch.Tensor] | None = None, partition_method: str = "parameters",
               micro_batch_size: int | None = None,
               model_parameters: Any = None, lr_scheduler: Any = None,
               pipeline_options: dict[str, Any] | None = None, **initialize_kwargs: Any) -> Any:
    """``deepspeed.initialize`` driven by ``strategy``; returns the engine (``DeepSpeedEngine``,
    or ``PipelineEngine`` when ``pipeline > 1``). Called as ``strategy.adapt("deepspeed", ...)``.

    :param model: an ``nn.Module``; with ``pipeline > 1`` an ``nn.Sequential`` or a list of
        layers, partitioned into stages by DeepSpeed (``partition_method``: ``"parameters"``,
        ``"uniform"``, ``"type:<regex>"``).
    :param optimizer: a torch optimizer (or DeepSpeed's optimizer callable, ``params -> optimizer``),
        or ``None`` with an ``"optimizer"`` entry in ``config``. With ``pipeline > 1`` a torch
        optimizer made over the whole model keeps only this rank's stage's parameters (changed in
        place, before any step).
    :param config: the user's DeepSpeed options; merged by :func:`~.config.build_config` (ZeRO
        stage and batch sizes from the Strategy; a contradiction is an error naming both).
    :param loss_fn: the pipeline's loss, ``loss_fn(outputs, labels)`` (required with ``pipeline > 1``).
    :param micro_batch_size: ``train_micro_batch_size_per_gpu`` (or set it in ``config``); it must
        agree with the Strategy's ``batch_size / (data x accumulate)``. Gradient accumulation is
        the Strategy's (``Strategy(accumulate=N)``): ``adapt(accumulation=)`` is refused.
    :param pipeline_options: further ``PipelineModule`` arguments with ``pipeline > 1``
        (``activation_checkpoint_interval``, ...); those the adapter sets, and those the surface
        refuses, are refused.
    :param initialize_kwargs: passed to ``deepspeed.initialize`` (``training_data``, ``collate_fn``, ...).
    """
    if model is None:
        raise TypeError("adapt('deepspeed') needs model= (an nn.Module; with pipeline > 1 an nn.Sequential or a "
                        "list of layers).")
    if "accumulation" in initialize_kwargs:
        raise TypeError(f"adapt('deepspeed', accumulation={initialize_kwargs['accumulation']!r}) is not taken: gradient "
                        "accumulation belongs to the Strategy, so the global batch means the same in every framework. "
                        "Use Strategy(accumulate=N) (the adapter writes gradient_accumulation_steps from it).")
    for reserved in ("mpu", "config_params", "args", "dist_init_required", "mesh_param"):
        if reserved in initialize_kwargs:
            raise TypeError(f"adapt('deepspeed') sets deepspeed.initialize's {reserved}= from the Strategy; do not pass it.")
    # 1. Everything that can be refused, before any process group or collective (the config first:
    # it needs no session when the topology names every size).
    topology = strategy.topology if strategy.topology.is_resolved else strategy.session().topology
    pipeline = topology.size("pipeline")
    ds_config = build_config(strategy, config, data_size=topology.size("data"),
                             torch_optimizer=isinstance(optimizer, torch.optim.Optimizer),
                             micro_batch_size=micro_batch_size)
    _check_both(optimizer, lr_scheduler, ds_config)
    _check_model(model, pipeline)
    _check_dtypes(model, strategy.shard_policy.stage)
    if pipeline_options is not None:
        from .surface import pipeline_refusal

        if pipeline == 1:
            raise TypeError(f"adapt('deepspeed', pipeline_options=) builds a PipelineModule, which needs pipeline > 1; "
                            f"the Strategy has pipeline={pipeline}. Drop pipeline_options=.")
        why = pipeline_refusal(pipeline_options)
        if why is not None:
            raise TypeError(f"adapt('deepspeed', pipeline_options=): {why}.")
    if pipeline != 1 and loss_fn is None:
        raise TypeError(f"With pipeline={pipeline}, adapt('deepspeed') needs loss_fn= (loss_fn(outputs, labels), "
                        "computed on the last stage).")
    if "LOCAL_RANK" not in os.environ:
        raise DeepSpeedSetupError("DeepSpeed reads LOCAL_RANK from the environment, and this process has none: start "
                                  "it with polyparallel.launch, `polyparallel launch` or torchrun.")
    why = shm_op_available()
    if why is not None:
        raise DeepSpeedSetupError(why)
    session = strategy.session()

    import deepspeed

    from polyparallel_torch.runtime import get_runtime

    # 2. The Strategy's groups (the first collectives), then DeepSpeed's communication backend on them.
    runtime = get_runtime(session)
    mpu = None
    if runtime.mesh is not None:
        deepspeed.comm.init_distributed(dist_backend=runtime.backend, dist_init_required=False, verbose=False)
        mpu = None if pipeline != 1 else _mpu(runtime)
    if pipeline != 1:
        model = _pipeline_module(model, session, loss_fn, partition_method, dict(pipeline_options or {}))
        if isinstance(optimizer, torch.optim.Optimizer):
            _keep_stage_params(optimizer, model)
    if model_parameters is None and optimizer is None and "optimizer" in ds_config:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model_parameters,
                                           lr_scheduler=lr_scheduler, mpu=mpu, config=ds_config,
                                           dist_init_required=None if runtime.mesh is None else False,
                                           **initialize_kwargs)
    return engine


def _mpu(runtime: Any) -> Any:
    from .mpu import TopologyMpu

    return TopologyMpu(runtime)


def engine_states(engine: Any) -> dict[str, torch.Tensor]:
    """The states ``strategy.sync_states(engine)`` syncs, under the names of the user's module:
    its buffers (BatchNorm statistics), and its parameters at ZeRO stage 0 only. From stage 1 on,
    DeepSpeed's optimizer holds the parameters' master copy (a partition per data rank), which
    keeps the replicas identical by construction and which a broadcast of the module's tensors
    would not reach (at stage 3 the module holds empty placeholders), so parameters are
    DeepSpeed's to keep in step."""
    module = engine.module
    states = dict(module.named_buffers())
    if engine.zero_optimization_stage() == 0:
        states.update(module.named_parameters())
    return {name: t for name, t in states.items() if isinstance(t, torch.Tensor)}
