"""Stage 0 (replicas): the adapter's Lightning strategy over Lightning's ``DDPStrategy``.

The model goes through ``strategy.wrap_model``: DDP over the data sub-mesh (data only), or the
runtime's tensor-parallel plan (``tensor > 1``). Checkpoints are polyparallel checkpoints (one
``torch.distributed.checkpoint`` directory, each shard written once, loadable at any topology and
into a plain module; :mod:`.checkpoint`).

**Lightning names relied on** beyond :mod:`.strategy`'s, all public: ``DDPStrategy.__init__``'s
arguments, ``setup_distributed`` (called by ``DDPStrategy.setup_environment``), ``configure_ddp``
(called by ``DDPStrategy.setup`` when fitting), ``setup_precision_plugin``, ``model_to_device``,
``lightning_module_state_dict``, ``optimizer_state``, ``save_checkpoint``, ``remove_checkpoint``,
``load_checkpoint``, ``load_model_state_dict``, ``load_optimizer_state_dict``,
``restore_checkpoint_after_setup``, ``lightning_restore_optimizer``, ``optimizers``. DDP communication hooks
(``ddp_comm_hook=``, ``ddp_comm_state=``, ``ddp_comm_wrapper=``) are registered with torch's public
``DistributedDataParallel.register_comm_hook``, as Lightning does (on CUDA only: Lightning's rule): the
runtime records each backward without a hook (``polyparallel_torch.ddp_trace``; and checks it
with ``GradPolicy(check_backward=True)``), so DDP's hook slot is Lightning's.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

from torch import nn

from . import checkpoint
from .namespaces import per_namespace_class
from .strategy import StrategyMixin

__all__ = ["DDPMixin", "ddp_strategy_class"]


class DDPMixin(StrategyMixin):
    """Stage 0 over Lightning's ``DDPStrategy`` (see the module docstring and :class:`StrategyMixin`).

    :param kwargs: Lightning ``DDPStrategy`` arguments (``start_method=``, ``accelerator=``,
        ``checkpoint_io=``, ``ddp_comm_hook=``...) and DDP arguments (``find_unused_parameters=``,
        ``static_graph=``), which reach ``strategy.wrap_model(ddp_kwargs=)``.
    """

    def _init_lightning(self, environment: Any, timeout: timedelta, kwargs: dict[str, Any]) -> None:
        base = next(c for c in type(self).__mro__ if c.__name__ == "DDPStrategy")
        named = set(inspect.signature(base).parameters) - {"kwargs"}  # the class: its __init__ minus self
        self._ddp_options = {k: v for k, v in kwargs.items() if k not in named}
        self._comm = {k: kwargs.get(k) for k in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper")}
        super(StrategyMixin, self).__init__(  # type: ignore[call-arg]  # the Lightning base class
            cluster_environment=environment, process_group_backend=self._pp.backend, timeout=timeout, **kwargs)

    def _wrap(self, model: nn.Module) -> nn.Module:
        """``strategy.wrap_model``: DDP over the data group, or the tensor-parallel plan (applied once)."""
        options: dict[str, Any] = {}
        if self.topology.size("tensor") > 1:
            if checkpoint.is_tensor_parallel(model):
                return model  # parallelised by an earlier fit/validate; replicas already equal
            options["plan"] = self._tensor_plan(model)
        if self._ddp_options:
            options["ddp_kwargs"] = dict(self._ddp_options)
        # Lightning's precision plugin applies Strategy(precision=) (.precision): not the runtime too.
        return self._pp.wrap_model(model, precision=None, **options)

    def configure_ddp(self) -> None:
        """Wrap through polyparallel; Lightning's DDP communication hooks only for a DDP model."""
        self.model = self._wrap(self.model)  # type: ignore[has-type]
        hook = self._comm["ddp_comm_hook"]
        if hook is not None and isinstance(self.model, nn.parallel.DistributedDataParallel) \
                and self.root_device.type == "cuda":
            wrapper = self._comm["ddp_comm_wrapper"]
            self.model.register_comm_hook(state=self._comm["ddp_comm_state"],
                                          hook=wrapper(hook) if wrapper is not None else hook)

    def setup(self, trainer: Any) -> None:
        """Lightning's setup for fitting; for validate/test/predict the tensor plan is applied too
        (Lightning's own DDP leaves the model bare there)."""
        self._refuse_layer_sync()
        if trainer.state.fn == "fit":
            super().setup(trainer)  # type: ignore[misc]
        else:
            # Lightning's DDPStrategy.setup for validate/test/predict, minus its
            # `_sync_module_states(self.model)`: that broadcasts every parameter and buffer from world
            # rank 0, which would overwrite tensor-parallel shards and bypass the StatePolicy
            # (`sync_states` runs at validation/test/predict start instead); plus the tensor plan.
            # A near copy of Lightning's branch: re-check it against DDPStrategy.setup on upgrades.
            self.accelerator.setup(trainer)  # type: ignore[attr-defined]
            self.precision_plugin.convert_module(self.model)
            self.model_to_device()  # type: ignore[attr-defined]
            if self.topology.size("tensor") > 1:
                self.model = self._wrap(self.model)
            self.setup_precision_plugin()  # type: ignore[attr-defined]
        self._after_setup(trainer)


#: ``ddp_strategy_class(namespace)``: :class:`DDPMixin` over the ``DDPStrategy`` of a Lightning
#: namespace (``"lightning.pytorch"`` or ``"pytorch_lightning"``); built on first use and cached.
ddp_strategy_class, __getattr__ = per_namespace_class(
    "PolyparallelDDPStrategy", DDPMixin, "{ns.pytorch}.strategies", "DDPStrategy", __name__)
