"""The everyday surface of :class:`polyparallel_jax.Model`, classified: plain data.

Each entry is one thing a user calls or passes (the Model's methods, their arguments, its
attributes, the Keras/Elegy surface users bring, the callbacks), with a status:

- ``works``: ``test`` names the scenario of ``tests/jax_plugin/test_surface.py`` that runs it at
  data=2 (a process of 2 devices) and at data=4 x tensor=2 against one device with the same
  global batch, evaluating on a set that does not divide;
- ``refused``: refused before anything runs (nothing placed, compiled or trained), with
  ``reason`` and what to do ``instead``; :func:`refuse` raises that message.

``python -m polyparallel_jax.surface`` prints the table (``docs/surface/jax.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ENTRIES", "Entry", "markdown", "refuse"]


@dataclass(frozen=True)
class Entry:
    """One item of the surface: ``name`` as written (``"fit(validation_data=)"``), ``kind``
    (method, argument, attribute, input, callback), ``status`` (works, refused), and ``test``
    (works) or ``reason`` and ``instead`` (refused)."""

    name: str
    kind: str
    status: str
    test: str = ""
    reason: str = ""
    instead: str = ""


def _works(name: str, kind: str, test: str) -> Entry:
    return Entry(name, kind, "works", test=test)


def _refused(name: str, kind: str, reason: str, instead: str) -> Entry:
    return Entry(name, kind, "refused", reason=reason, instead=instead)


_A, _M, _T = "argument", "method", "attribute"

ENTRIES: tuple[Entry, ...] = (
    # -- building the Model -------------------------------------------------------------------
    _works("Model(module=)", _A, "basic"),
    _works("Model(loss=)", _A, "callables"),
    _works("Model(optimizer=)", _A, "basic"),
    _works("Model(metrics=)", _A, "callables"),
    _works("Model(strategy=)", _A, "model-strategy"),
    _works("Model(plan=)", _A, "plan"),
    _works("Model(sync_every=)", _A, "sync-every"),
    _refused("compile", _M, "Keras' compile() step does not exist here: the Model takes its loss, optimizer and "
             "metrics when it is built (as Elegy's does)", "Model(module, loss=, optimizer=, metrics=)"),
    # -- fit ----------------------------------------------------------------------------------
    _works("fit", _M, "basic"),
    *(_works(f"fit({arg}=)", _A, "basic") for arg in ("x", "y", "epochs", "batch_size", "strategy", "shuffle", "seed")),
    _works("fit(verbose=)", _A, "verbose"),
    _works("fit(validation_data=)", _A, "validation"),
    _works("fit(validation_batch_size=)", _A, "validation"),
    _works("fit(validation_freq=)", _A, "validation"),
    _works("fit(validation_split=)", _A, "validation-split"),
    _works("fit(callbacks=)", _A, "callbacks"),
    *(_works(f"fit({arg}=)", _A, "resume") for arg in ("checkpoint", "checkpoint_every", "resume")),
    _refused("fit(sample_weight=)", _A, "per-sample weights are not sharded with the rows",
             "weight the per-sample loss in loss=fn(predictions, targets), e.g. with weights looked up from the targets"),
    _refused("fit(class_weight=)", _A, "class weights are not applied by fit",
             "loss=lambda p, t: weights[t] * polyparallel_jax.losses.cross_entropy(p, t) with weights a jnp array"),
    _refused("fit(initial_epoch=)", _A, "epochs are counted by the checkpoint fit resumes from",
             "fit(checkpoint=DIR, resume=True): the run continues at the saved epoch and step"),
    _refused("fit(steps_per_epoch=)", _A, "an epoch is one pass over the arrays given",
             "pass the rows an epoch should see (x[:n], y[:n])"),
    _refused("fit(validation_steps=)", _A, "validation counts every validation row exactly once",
             "pass fewer validation rows in validation_data="),
    _refused("fit(x=<iterator or dataset>)", "input", "fit shards host arrays by the strategy (every data rank its "
             "rows of the same global order); an iterator's batches could not be split so",
             "materialise the data as numpy arrays (np.asarray) and pass x= and y="),
    # -- evaluate and predict -----------------------------------------------------------------
    _works("evaluate", _M, "basic"),
    *(_works(f"evaluate({arg}=)", _A, "basic") for arg in ("x", "y", "batch_size")),
    _works("evaluate(strategy=)", _A, "model-strategy"),
    _works("evaluate(verbose=)", _A, "verbose"),
    _refused("evaluate(sample_weight=)", _A, "per-sample weights are not sharded with the rows",
             "weight the per-sample loss in loss=fn(predictions, targets)"),
    _refused("evaluate(steps=)", _A, "evaluate counts every row exactly once", "pass the rows to evaluate"),
    _refused("evaluate(callbacks=)", _A, "evaluate runs no callbacks", "call what the callback would do after evaluate"),
    _refused("evaluate(return_dict=)", _A, "evaluate always returns a dict name -> value (Keras' return_dict=True)",
             "drop return_dict= and read the dict (list(result.values()) for Keras' list)"),
    _works("predict", _M, "basic"),
    *(_works(f"predict({arg}=)", _A, "basic") for arg in ("x", "batch_size")),
    _works("predict(strategy=)", _A, "model-strategy"),
    _works("predict(verbose=)", _A, "verbose"),
    _refused("predict(steps=)", _A, "predict returns every row exactly once, in order", "pass the rows to predict"),
    _refused("predict(callbacks=)", _A, "predict runs no callbacks", "call what the callback would do after predict"),
    # -- saving and placement -----------------------------------------------------------------
    _works("save", _M, "save-load"),
    _works("save(path=)", _A, "save-load"),
    _works("save(**extras)", _A, "save-load"),
    _works("load", _M, "save-load"),
    *(_works(f"load({arg}=)", _A, "save-load") for arg in ("path", "strategy", "loader")),
    _works("place", _M, "state"),
    _works("place(strategy=)", _A, "state"),
    _works("checkpoint_state", _M, "state"),
    _works("restore_state", _M, "state"),
    *(_works(f"restore_state({arg}=)", _A, "state") for arg in ("read", "optimizer", "progress")),
    # -- attributes ---------------------------------------------------------------------------
    *(_works(name, _T, "basic") for name in ("history", "module", "optimizer")),
    _works("strategy", _T, "model-strategy"),
    _works("plan", _T, "plan"),
    _works("sync_every", _T, "sync-every"),
    _works("stop_training", _T, "callbacks"),
    _works("placed_strategy", _T, "state"),
    _works("fit_progress", _T, "state"),
    _works("batch_stats_per_device", _T, "local-stats"),
    # -- callbacks (polyparallel_jax.callbacks) -----------------------------------------------
    _works("Callback (set_model, on_train_begin, on_epoch_end, on_train_end)", "callback", "callbacks"),
    _works("EarlyStopping(monitor=, min_delta=, patience=, mode=)", "callback", "callbacks"),
    _works("EarlyStopping(restore_best_weights=)", "callback", "callbacks"),
    _works("ModelCheckpoint(filepath=, monitor=, save_best_only=, mode=)", "callback", "callbacks"),
)

_BY_NAME = {entry.name: entry for entry in ENTRIES}


def refuse(method: str, given: Mapping[str, object]) -> None:
    """Raise for arguments of ``method`` the classification refuses (``TypeError`` with its
    reason and what to do instead), or that it does not know (``TypeError`` listing them)."""
    if not given:
        return
    messages, unknown = [], []
    for name in given:
        entry = _BY_NAME.get(f"{method}({name}=)")
        if entry is not None and entry.status == "refused":
            messages.append(f"Model.{method}({name}=) is not supported: {entry.reason}. Instead: {entry.instead}.")
        else:
            unknown.append(name)
    if unknown:
        messages.append(f"Model.{method}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}.")
    raise TypeError(" ".join(messages))


def refusal(name: str) -> str:
    """The message of the refused entry ``name``."""
    entry = _BY_NAME[name]
    return f"Model.{name} is not supported: {entry.reason}. Instead: {entry.instead}."


def markdown() -> str:
    """``docs/surface/jax.md``: the table, kind by kind, and the counts."""
    works = sum(entry.status == "works" for entry in ENTRIES)
    lines = ["# The JAX `Model`'s surface", "",
             "Generated from `plugins/polyparallel_jax/surface.py` by `python -m polyparallel_jax.surface` (a test "
             "checks that this file is what it prints). **works**: run by the named scenario of "
             "`tests/jax_plugin/test_surface.py` at data=2 (a process of 2 devices) and at data=4 x tensor=2 against "
             "one device with the same global batch, evaluating on a set that does not divide. **refused**: refused "
             "before anything is placed, compiled or trained, with the reason and what to do instead.", "",
             f"works: {works}, refused: {len(ENTRIES) - works}, total: {len(ENTRIES)}", ""]
    for kind in ("method", "argument", "attribute", "input", "callback"):
        rows = [entry for entry in ENTRIES if entry.kind == kind]
        lines += [f"## {kind.capitalize()}s", "", "| surface | status | test / reason | instead |", "|---|---|---|---|"]
        for entry in rows:
            detail = f"`{entry.test}`" if entry.status == "works" else entry.reason
            lines.append(f"| `{entry.name}` | {entry.status} | {detail} | {entry.instead} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
