"""Stages 1-3 (sharded over the data axis): the adapter's Lightning strategy over Lightning's
``ModelParallelStrategy`` (FSDP2 + tensor parallelism on a ``DeviceMesh``; Lightning >= 2.4).

Lightning's own strategy asks the LightningModule to parallelise itself in ``configure_model``;
here the polyparallel Strategy does it: ``strategy.wrap_model(lightning_module)`` applies the
tensor plan (``tensor > 1``), then FSDP2 ``fully_shard`` over the data dimension of the torch
runtime's mesh, in place (the torch runtime's contract for ``Strategy(zero=1|2|3)``). A module's
own ``configure_model`` still runs first, as Lightning calls it for every strategy (to build
layers, e.g. on the meta device), but it must not parallelise: that is the Strategy's.

FSDP2 gathers a module's parameters in the module's forward hooks, and Lightning calls
``training_step`` (not ``forward``) on the LightningModule; so each step is routed *through*
the wrapped module's ``forward`` (as Lightning routes steps through a DDP wrapper) and FSDP2's
hooks run around it.

Checkpoints are polyparallel checkpoints (:mod:`.checkpoint`): one ``torch.distributed.checkpoint``
directory written through ``strategy.save`` (each rank its shards), which loads at another topology,
in another framework or in one process. Directories Lightning's ``ModelParallelStrategy`` wrote
(earlier versions of the adapter: they hold ``meta.pt``) are still read, as that strategy reads
them but with the allow-listed reader (nothing is unpickled).

**Lightning names relied on** beyond :mod:`.strategy`'s, all public: ``ModelParallelStrategy``
(its ``__init__`` arguments ``process_group_backend``, ``timeout``; ``setup_optimizers``,
``tensor_init_context``, ``model_to_device``), ``device_mesh``,
``Strategy.training_step``/``validation_step``/``test_step``/``predict_step`` and the precision
plugin's ``train_step_context``/``val_step_context``/``test_step_context``/``predict_step_context``,
``accelerator.setup_device``/``setup``, ``setup_precision_plugin``.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

from torch import nn

from .checkpoint import load_lightning_directory
from .namespaces import per_namespace_class
from .strategy import StrategyMixin

__all__ = ["ShardedMixin", "sharded_strategy_class", "is_sharded"]

#: Lightning's step methods and the precision plugin's context for each.
_STEP_CONTEXTS = {"training_step": "train_step_context", "validation_step": "val_step_context",
                  "test_step": "test_step_context", "predict_step": "predict_step_context"}


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` was sharded by FSDP2 already (an earlier fit/validate of the same module)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule) or any(isinstance(m, FSDPModule) for m in module.modules())


class ShardedMixin(StrategyMixin):
    """Stages 1-3 over Lightning's ``ModelParallelStrategy`` (module docstring; :class:`StrategyMixin`).

    :param kwargs: none (``save_distributed_checkpoint=True`` is accepted for compatibility: the
        checkpoint is always one polyparallel DCP directory).
    """

    def _init_lightning(self, environment: Any, timeout: timedelta, kwargs: dict[str, Any]) -> None:
        unknown = sorted(set(kwargs) - {"save_distributed_checkpoint"})
        if unknown:
            raise TypeError(
                f"adapt('lightning') at sharding stage zero={self._pp.shard_policy.stage} takes plan= and "
                f"save_distributed_checkpoint= only (Lightning's ModelParallelStrategy); received {unknown}. "
                "DDP options (find_unused_parameters=, ...) apply at zero=0."
            )
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise TypeError(
                "adapt('lightning', save_distributed_checkpoint=False): the adapter always writes one polyparallel "
                "checkpoint directory (torch.distributed.checkpoint). For one full file, load it into a plain module "
                "in one process (strategy.load(path, model=module) with pp.Strategy(data=1)) and torch.save its "
                "state_dict()."
            )
        # No sizes: Lightning's own mesh is never built (setup_environment uses the runtime's).
        super(StrategyMixin, self).__init__(  # type: ignore[call-arg]  # the Lightning base class
            process_group_backend=self._pp.backend, timeout=timeout)
        self.cluster_environment = environment

    @property
    def device_mesh(self) -> Any:
        """The torch runtime's ``DeviceMesh`` (dimensions named like the topology's axes:
        ``pipeline``, ``data``, ``tensor``)."""
        return self.runtime.mesh

    def setup_environment(self) -> None:
        """The device, then the runtime's process groups and mesh (not Lightning's)."""
        self.accelerator.setup_device(self.root_device)  # type: ignore[attr-defined]
        self.setup_distributed()

    def setup(self, trainer: Any) -> None:
        """Parallelise through ``strategy.wrap_model`` (once per module), then Lightning's
        optimizer and precision setup (``ModelParallelStrategy.setup`` minus its demand for a
        ``configure_model`` that parallelises)."""
        self._refuse_layer_sync()
        self.accelerator.setup(trainer)  # type: ignore[attr-defined]
        self.model = self.precision_plugin.convert_module(self.model)  # type: ignore[has-type]
        self.model_to_device()  # type: ignore[attr-defined]
        if not is_sharded(self.model):
            options = {"plan": self._tensor_plan(self.model)} if self.topology.size("tensor") > 1 else {}
            # Lightning's precision plugin applies Strategy(precision=) (.precision): not the runtime too.
            self.model = self._pp.wrap_model(self.model, precision=None, **options)
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)  # type: ignore[attr-defined]
        self.setup_precision_plugin()  # type: ignore[attr-defined]
        self._after_setup(trainer)

    def _load_legacy_directory(self, path: str, weights_only: bool | None) -> dict[str, Any]:
        """A directory in Lightning's ``ModelParallelStrategy`` format (what earlier versions of the
        adapter wrote at stages 1-3), read as that strategy's ``load_checkpoint`` reads it but
        never unpickling anything (:func:`.checkpoint.load_lightning_directory`)."""
        return load_lightning_directory(self, path, weights_only)

    # -- steps run through the sharded module's forward -------------------------------------------------
    def _step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        module, wrapper = self.lightning_module, self.model  # type: ignore[attr-defined]
        context = getattr(self.precision_plugin, _STEP_CONTEXTS[name])
        with context():
            return _through_forward(wrapper, module, name, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``training_step``, called through the sharded module's ``forward``."""
        return self._step("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``validation_step``, through the sharded module's ``forward``."""
        return self._step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``test_step``, through the sharded module's ``forward``."""
        return self._step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``predict_step``, through the sharded module's ``forward``."""
        return self._step("predict_step", *args, **kwargs)


def _through_forward(wrapper: nn.Module, module: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
    """``module.<name>(*args, **kwargs)`` called as ``wrapper(*args, **kwargs)``, so the forward
    hooks of ``wrapper`` (FSDP2's parameter gathering; it may be ``module`` itself) run around it.
    ``module.forward`` is restored before the step runs (the step may call ``self(x)``)."""
    had_own = "forward" in vars(module)
    original = module.forward

    def restore() -> None:
        if had_own:
            module.forward = original
        else:
            vars(module).pop("forward", None)

    def step(*step_args: Any, **step_kwargs: Any) -> Any:
        restore()
        return getattr(module, name)(*step_args, **step_kwargs)

    module.forward = step
    with contextlib.ExitStack() as stack:
        stack.callback(restore)
        return wrapper(*args, **kwargs)


#: ``sharded_strategy_class(namespace)``: :class:`ShardedMixin` over the ``ModelParallelStrategy``
#: of a Lightning namespace (``"lightning.pytorch"`` or ``"pytorch_lightning"``); cached.
sharded_strategy_class, __getattr__ = per_namespace_class(
    "PolyparallelShardedStrategy", ShardedMixin, "{ns.pytorch}.strategies", "ModelParallelStrategy", __name__)
