"""DeepSpeed for polyparallel: ``strategy.adapt("deepspeed", model=..., optimizer=..., config=...)``
returns a DeepSpeed engine whose ZeRO stage, batch sizes and process groups come from the Strategy.

- :mod:`.adapter` — :func:`~.adapter.initialize` (what ``adapt("deepspeed")`` calls);
- :mod:`.config` — :func:`~.config.build_config`: the DeepSpeed config a Strategy implies
  (framework-free: inspect it, or refuse a contradiction, before anything starts);
- :mod:`.mpu` — the ``mpu`` backed by the Strategy's process groups;
- :mod:`.checkpoint` — ``strategy.save`` / ``strategy.load`` of an engine, in the torch format;
- :mod:`.surface` — what of DeepSpeed works and what is refused (``docs/surface/deepspeed.md``);
- :mod:`.ignite` — ignite engines stepping a DeepSpeed engine (``strategy.adapt("ignite")``);
- :mod:`.testing` — the conformance driver.

Importing this package imports neither torch nor deepspeed.
"""

from .config import PIPELINE_ZERO_REASON, UnsupportedConfigError, build_config, check_strategy

__all__ = ["PIPELINE_ZERO_REASON", "UnsupportedConfigError", "build_config", "check_strategy"]
