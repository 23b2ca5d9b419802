"""The DeepSpeed adapter's declared surface: each everyday entry of the installed DeepSpeed, and
whether it **works** (with the test that shows it: at data=2 against a single process with the
same global batch, evaluated on a set that does not divide evenly) or is **refused** (before any
collective, by :func:`~.config.build_config` or ``adapt``, with the reason and what to do instead).

Plain data, framework-free (imports neither torch nor deepspeed): ``ENTRIES`` is a tuple of
:class:`Entry` ``(name, kind, status, detail)``. The kinds:

- ``method``: the engine's everyday methods (a declared list: DeepSpeed has ~170 public engine
  methods, most of them accessors);
- ``config``: every top-level key ``DeepSpeedConfig`` reads (the tests enumerate them from the
  installed DeepSpeed, so a new key fails a test until it is classified);
- ``zero_optimization``: every field of ``DeepSpeedZeroConfig`` (enumerated likewise; by field
  name, as DeepSpeed accepts it, and its ``stage3_`` alias);
- ``pipeline_module``: every argument of ``deepspeed.pipe.PipelineModule`` (enumerated likewise;
  passed through ``adapt(..., pipeline_options={...})``).

``python -m polyparallel_deepspeed.surface`` prints the table of ``docs/surface/deepspeed.md``
(a test checks that the committed one is this output).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ENTRIES", "Entry", "refusal", "render"]

WORKS, REFUSED = "works", "refused"
KINDS = ("method", "config", "zero_optimization", "pipeline_module")

_T = "tests/deepspeed_plugin/"
CONFORMANCE = _T + "test_conformance.py::TestDeepSpeedZero3Data2"  # train + uneven evaluation, data=2 vs one process
PIPELINE_CONFORMANCE = _T + "test_conformance.py::TestDeepSpeedPipeline2Data2Zero0"
VARIANTS = _T + "test_surface.py::test_config_variants_match_a_single_process"
PIPELINE_VARIANTS = _T + "test_surface.py::test_pipeline_options_match_a_single_process"
CHECKPOINT = _T + "test_checkpoint.py::test_round_trips_at_every_zero_stage_and_into_fsdp2_and_a_plain_module"
CHECKPOINT_V2 = _T + "test_checkpoint.py::test_async_save_manager_partial_loads_failures_and_export_of_an_engine"

# The reasons (what is wrong, and what to do instead).
UNTESTED = ("not tested by polyparallel against a single-process run; leave it out, or call deepspeed.initialize "
            "yourself for it")
PRECISION = ("the precision is set on the Strategy (Strategy(precision='bf16-mixed') writes the bf16 section and "
             "communication_data_type); this mechanism is not the one the adapter maps it to, or its precision "
             "(fp16-mixed) is refused on this CPU accelerator; leave it out")
BF16 = _T + "test_precision.py::test_bf16_mixed_data2_matches_one_process_and_a_hand_written_config"
OFFLOAD = ("ZeRO-Offload is not tested here, and partitions swapped to host/NVMe cannot be checkpointed by "
           "strategy.save; leave it out")
PARALLEL = ("parallelism comes from the Strategy's topology (the adapter runs the data and pipeline axes); set the "
            "axes on the Strategy")
MONITOR = ("DeepSpeed's monitors are not tested here; log what strategy.reduce_metrics returns from the logger rank "
           "instead")
STRATEGY = "set by the adapter from the Strategy; a contradicting value is refused naming both"
ADAPTER = "set by the adapter"


@dataclass(frozen=True)
class Entry:
    """One entry of the surface: ``detail`` is the test (a pytest node id) when ``status`` is
    ``"works"``, the reason and the alternative when ``"refused"``."""

    name: str
    kind: str
    status: str
    detail: str


def _works(kind: str, test: str, *names: str) -> list[Entry]:
    return [Entry(n, kind, WORKS, test) for n in names]


def _refused(kind: str, reason: str, *names: str) -> list[Entry]:
    return [Entry(n, kind, REFUSED, reason) for n in names]


_METHODS = [
    *_works("method", CONFORMANCE, "forward (engine(x))", "backward", "step", "train", "eval"),
    *_works("method", PIPELINE_CONFORMANCE, "train_batch", "eval_batch"),
    *_works("method", _T + "test_surface.py::test_deepspeeds_own_checkpoints_round_trip",
            "save_checkpoint", "load_checkpoint"),
    Entry("strategy.save / strategy.load (model=engine)", "method", WORKS, CHECKPOINT),
    *_works("method", CHECKPOINT_V2, "strategy.async_save (model=engine)", "pp.CheckpointManager (model=engine)",
            "strategy.load (model=engine, keys= / strict=False)", "polyparallel checkpoint export"),
]

_CONFIG = [
    *_works("config", VARIANTS, "gradient_accumulation_steps", "gradient_clipping", "optimizer", "scheduler",
            "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "zero_optimization",
            "zero_allow_untested_optimizer"),
    *_works("config", CONFORMANCE, "train_batch_size", "train_micro_batch_size_per_gpu"),
    *_works("config", BF16, "bf16", "communication_data_type"),
    *_refused("config", PRECISION, "fp16", "bfloat16", "amp", "torch_autocast", "data_types",
              "seq_parallel_communication_data_type"),
    *_refused("config", PARALLEL, "tensor_parallel", "expert_parallel", "use_data_before_expert_parallelism",
              "pipeline"),
    *_refused("config", MONITOR, "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger",
              "timers"),
    *_refused("config", OFFLOAD, "zero_force_ds_cpu_optimizer", "aio", "nebula", "datastates_ckpt"),
    *_refused("config", "DeepSpeed's activation-checkpointing config applies only to models that call "
                        "deepspeed.checkpointing themselves, which is not tested here; checkpoint a pipeline's layers "
                        "with adapt(..., pipeline_options={'activation_checkpoint_interval': k})",
              "activation_checkpointing"),
    *_refused("config", UNTESTED, "autotuning", "checkpoint", "compile", "compression_training", "curriculum_learning",
              "data_efficiency", "dataloader_drop_last", "disable_allgather", "disable_python_gc", "eigenvalue",
              "elasticity", "gradient_allreduce_op", "gradient_predivide_factor", "graph_harvesting", "hybrid_engine",
              "log_level", "managed_gradient_accumulation", "prescale_gradients", "progressive_layer_drop",
              "quantize_training", "sparse_attention", "sparse_gradients", "vocabulary_size", "weight_quantization"),
]

_ZERO2 = ("contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
          "allgather_partitions", "allgather_bucket_size", "overlap_comm", "round_robin_gradients")
_ZERO3 = ("sub_group_size", "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
          "max_live_parameters", "max_reuse_distance")
_ALIASES = {n: "stage3_" + n for n in (*_ZERO3[1:], "gather_16bit_weights_on_model_save", "module_granularity_threshold",
                                       "use_all_reduce_for_fetch_params", "allgather_sequential")}
_ZERO = [
    Entry("stage", "zero_optimization", WORKS, CONFORMANCE),
    *_works("zero_optimization", VARIANTS, *_ZERO2, *_ZERO3),
    *_refused("zero_optimization", OFFLOAD, "offload_param", "offload_optimizer", "cpu_offload", "cpu_offload_param",
              "cpu_offload_use_pin_memory", "zenflow", "save_muon_momentum_buffer_in_memory"),
    *_refused("zero_optimization", UNTESTED, "compute_grad_norm", "load_from_fp32_weights", "elastic_checkpoint",
              "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
              "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential",
              "ignore_unused_parameters", "legacy_stage1", "parameter_alignment", "zero_hpz_partition_size",
              "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
              "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
              "log_trace_cache_warnings", "enable_sanity_checks", "leaf_module"),
]

_PIPELINE = [
    *_works("pipeline_module", PIPELINE_VARIANTS, "activation_checkpoint_interval"),
    *_works("pipeline_module", PIPELINE_CONFORMANCE, "partition_method"),
    *_refused("pipeline_module", "the adapter builds it from the Strategy: give the nn.Sequential (or list of layers) "
                                 "as model= and loss_fn= to adapt, the pipeline size on the Strategy, "
                                 "partition_method= to adapt", "layers", "num_stages", "topology", "loss_fn"),
    *_refused("pipeline_module", "the adapter sets dynamic_shape=True, so that evaluation batches of any size (an "
                                 "uneven shard's short last batch) run", "dynamic_shape"),
    *_refused("pipeline_module", "these seed LayerSpec layers as DeepSpeed builds them; the adapter is given layers "
                                 "already built, so they would do nothing: seed before building the model",
              "seed_layers", "seed_fn", "base_seed"),
    *_refused("pipeline_module", UNTESTED, "activation_checkpoint_func", "checkpointable_layers"),
]

ENTRIES: tuple[Entry, ...] = (*_METHODS, *_CONFIG, *_ZERO, *_PIPELINE)
_BY_KIND = {kind: {e.name: e for e in ENTRIES if e.kind == kind} for kind in KINDS}


def aliases() -> dict[str, str]:
    """``zero_optimization`` field -> its ``stage3_`` alias (DeepSpeed accepts both names)."""
    return dict(_ALIASES)


def _zero_entry(name: str) -> Entry | None:
    by_name = _BY_KIND["zero_optimization"]
    if name in by_name:
        return by_name[name]
    field = next((f for f, alias in _ALIASES.items() if alias == name), None)
    return by_name.get(field) if field is not None else None


def _off(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("enabled") is False and len(value) == 1


def refusal(config: Mapping[str, Any]) -> str | None:
    """Why ``config`` (a user's DeepSpeed config) is refused, or ``None``. A top-level section
    given as ``{"enabled": false}`` is off, and accepted."""
    for key, value in config.items():
        entry = _BY_KIND["config"].get(key)
        if entry is None:
            return (f"the DeepSpeed config key {key!r} is not one DeepSpeed reads (it would be ignored silently); "
                    "check its spelling (docs/surface/deepspeed.md lists the keys and what the adapter does with each)")
        if entry.status == REFUSED and not _off(value):
            return f"the DeepSpeed config key {key!r} is refused: {entry.detail}"
    zero = config.get("zero_optimization")
    if isinstance(zero, Mapping):
        for key, value in zero.items():
            entry = _zero_entry(key)
            if entry is None:
                return (f"zero_optimization.{key} is not a ZeRO option DeepSpeed reads (it would be ignored silently); "
                        "check its spelling (docs/surface/deepspeed.md lists them)")
            if entry.status == REFUSED and value is not None and not _off(value):
                return f"zero_optimization.{key} is refused: {entry.detail}"
    return None


def pipeline_refusal(options: Mapping[str, Any]) -> str | None:
    """Why ``adapt(pipeline_options=)`` is refused, or ``None``."""
    for key in options:
        entry = _BY_KIND["pipeline_module"].get(key)
        if entry is None:
            return f"PipelineModule takes no argument {key!r} (docs/surface/deepspeed.md lists its arguments)"
        if entry.status == REFUSED:
            return f"PipelineModule's {key!r} is refused: {entry.detail}"
    return None


def counts() -> dict[str, int]:
    """Entries that work, are refused, and in all."""
    works = sum(e.status == WORKS for e in ENTRIES)
    return {"works": works, "refused": len(ENTRIES) - works, "total": len(ENTRIES)}


def render() -> str:
    """The Markdown table of ``docs/surface/deepspeed.md``."""
    c = counts()
    lines = [
        "# DeepSpeed: the declared surface",
        "",
        "Generated from `plugins/polyparallel_deepspeed/surface.py` by `python -m polyparallel_deepspeed.surface`",
        "(`tests/deepspeed_plugin/test_surface.py` checks that this file is its output). **works**: tested at",
        "data=2 against a single process with the same global batch, on an evaluation set that does not divide",
        "evenly (the test named). **refused**: before any collective, with this reason. Config keys and ZeRO and",
        "PipelineModule options are enumerated from the installed DeepSpeed, so a new one fails the tests until it",
        "is classified; the methods are a declared list of the engine's everyday ones.",
        "",
        f"**{c['works']} work, {c['refused']} refused, {c['total']} in all.**",
        "",
        "| kind | entry | status | test, or why refused |",
        "|---|---|---|---|",
    ]
    for kind in KINDS:
        for e in sorted((e for e in ENTRIES if e.kind == kind), key=lambda e: (e.status != WORKS, e.name)):
            shown = f"`{e.name}`" + (f" (`{_ALIASES[e.name]}`)" if kind == "zero_optimization" and e.name in _ALIASES else "")
            detail = f"`{e.detail}`" if e.status == WORKS else e.detail
            lines.append(f"| {kind} | {shown} | {e.status} | {detail} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
