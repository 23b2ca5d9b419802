"""What the ``deepspeed`` adapter runs, as data the core checks before any process starts.

Framework-free (imports neither torch nor deepspeed), at the bottom of the plugin: the hook module
(:mod:`.plugin`) registers it and :mod:`.config` applies it when it builds a config.
"""

from __future__ import annotations

import polyparallel as pp

__all__ = ["CAPABILITIES", "PIPELINE_ZERO_REASON", "PRECISIONS", "PRECISION_REASONS"]

#: DeepSpeed's own reason (``PipelineEngine.__init__`` asserts it): the pipeline engine schedules
#: the gradient all-reduce itself, which ZeRO 2/3's partitioned gradients cannot take part in.
PIPELINE_ZERO_REASON = "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"

#: The precisions the adapter runs (:mod:`.precision` writes DeepSpeed's ``bf16`` section for
#: "bf16-mixed"; at ZeRO 0-3, tested at data=2 against one process and a hand-written config).
PRECISIONS = frozenset({"32", "bf16-mixed"})
#: Why the others are refused before launch.
PRECISION_REASONS = {
    "bf16-true": "DeepSpeed's bf16 mode keeps a float32 master copy of the parameters and float32 optimizer state in "
                 "its optimizer; bfloat16 parameters and optimizer state need its bf16_master_weights_and_grads and "
                 "bf16_optimizer_states options (ZeRO 1-3 only), which are not tested against a single process here. "
                 "Use 'bf16-mixed'",
    "fp16-mixed": "DeepSpeed's CPU accelerator runs float16 only where oneDNN has float16 kernels "
                  "(is_fp16_supported(); this project's CPUs have none), and its fp16 optimizer with the dynamic loss "
                  "scaler is not tested against a single process here. Use 'bf16-mixed' (bfloat16 keeps float32's "
                  "exponent range and needs no loss scaling)",
    "custom": "the adapter maps the presets '32' and 'bf16-mixed' to DeepSpeed's config; other combinations of "
              "dtypes are not tested here",
}

#: Data parallelism (ZeRO 0-3 over the data axis) and DeepSpeed's pipeline engine (with data);
#: on the torch runtime, whose process groups DeepSpeed uses. Pipeline with ZeRO 2/3 is refused
#: before launch (``stages_with``, which ``config.check_strategy`` also applies), with DeepSpeed's reason.
CAPABILITIES = pp.Capabilities(
    "deepspeed", axes={"data", "pipeline"}, stages={0, 1, 2, 3}, runtimes={"torch"},
    stages_with={"pipeline": ({0, 1}, f"DeepSpeed says {PIPELINE_ZERO_REASON!r} (its pipeline engine reduces gradients "
                                      "itself)")},
    features={"zero", "pipeline_module", "mpu_from_topology", "metrics_over_data_group", "timeouts"},
    precisions=PRECISIONS, precision_reasons=PRECISION_REASONS, accumulation=True,
)
