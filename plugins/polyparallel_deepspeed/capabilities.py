"""What the ``deepspeed`` adapter runs, as data the core checks before any process starts.

Framework-free (imports neither torch nor deepspeed), at the bottom of the plugin: the hook module
(:mod:`.plugin`) registers it and :mod:`.config` applies it when it builds a config.
"""

from __future__ import annotations

import polyparallel as pp

__all__ = ["CAPABILITIES", "PIPELINE_ZERO_REASON"]

#: DeepSpeed's own reason (``PipelineEngine.__init__`` asserts it): the pipeline engine schedules
#: the gradient all-reduce itself, which ZeRO 2/3's partitioned gradients cannot take part in.
PIPELINE_ZERO_REASON = "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"

#: Data parallelism (ZeRO 0-3 over the data axis) and DeepSpeed's pipeline engine (with data);
#: on the torch runtime, whose process groups DeepSpeed uses. Pipeline with ZeRO 2/3 is refused
#: before launch (``stages_with``, which ``config.check_strategy`` also applies), with DeepSpeed's reason.
CAPABILITIES = pp.Capabilities(
    "deepspeed", axes={"data", "pipeline"}, stages={0, 1, 2, 3}, runtimes={"torch"},
    stages_with={"pipeline": ({0, 1}, f"DeepSpeed says {PIPELINE_ZERO_REASON!r} (its pipeline engine reduces gradients "
                                      "itself)")},
    features={"zero", "pipeline_module", "mpu_from_topology", "metrics_over_data_group", "timeouts"},
)
