"""``polyparallel/hookspecs.py``: a meta-test of the plugin contract.

It fails when a hook is added without documentation (parameters, return meaning, firstresult
behaviour), or without a case in :data:`CASES` proving that the core calls it: a recording plugin
implements every hook, and each case goes through the public path that should call the hook
(``Strategy.shard_data`` -> ``polyparallel_shard_data``, ``polyparallel launch`` ->
``polyparallel_launch_script``, ...) and checks the hook's arguments and that its answer is used.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import polyparallel as pp
from polyparallel import _checkpoints, hookspecs
from polyparallel import cli as cli_module

SPECS = {name: fn for name, fn in vars(hookspecs).items() if hasattr(fn, "polyparallel_spec")}
FIVE_OPERATIONS = ("shard_data", "wrap_model", "sync_grads", "reduce_metrics", "sync_states")


def is_firstresult(fn) -> bool:
    return bool(fn.polyparallel_spec.get("firstresult"))


def test_the_contract_is_there():
    assert len(SPECS) >= 10
    for operation in FIVE_OPERATIONS:
        assert is_firstresult(SPECS[f"polyparallel_{operation}"]), operation
    for registry in ("polyparallel_register_adapters", "polyparallel_capabilities", "polyparallel_session_start"):
        assert not is_firstresult(SPECS[registry]), registry


def test_every_public_function_of_the_module_is_a_spec():
    stray = [name for name, obj in vars(hookspecs).items()
             if name.startswith("polyparallel_") and inspect.isfunction(obj) and name not in SPECS]
    assert stray == [], f"functions that look like hooks but are not marked @hookspec: {stray}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_is_named_and_registered(name):
    assert name.startswith("polyparallel_")
    assert getattr(pp.PluginManager(autoload=False).hook, name).has_spec()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_is_documented(name):
    fn = SPECS[name]
    doc = inspect.getdoc(fn) or ""
    assert doc, f"{name} has no docstring"
    assert ":return:" in doc, f"{name}'s docstring does not say what its return value means (:return:)"
    for parameter in inspect.signature(fn).parameters:
        assert f":param {parameter}:" in doc, f"{name}'s docstring does not document {parameter!r} (:param {parameter}:)"
    if is_firstresult(fn):
        assert "Stops at first non-None result" in doc, f"{name} is firstresult but its docstring does not say so"


# -- every hook is called by the core, through its public path -------------------------------------------
class Subject:
    """An object only the recording plugin owns."""


class Recorder:
    """Implements every hook; records each call (hook name, arguments) and answers so that the
    caller's result shows the answer was used."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def seen(self, hook: str) -> list[dict[str, Any]]:
        return [kwargs for name, kwargs in self.calls if name == hook]

    @pp.hookimpl
    def polyparallel_register_adapters(self, register):
        self.calls.append(("polyparallel_register_adapters", {}))
        register("recorded", lambda strategy, **kw: ("adapted", strategy, kw),
                 capabilities=pp.Capabilities("recorded", axes={"data"}), description="records calls")

    @pp.hookimpl
    def polyparallel_capabilities(self):
        self.calls.append(("polyparallel_capabilities", {}))
        return pp.Capabilities("recorded-runtime", axes={"data"})

    @pp.hookimpl
    def polyparallel_register_demos(self, register):
        self.calls.append(("polyparallel_register_demos", {}))
        register("recorded", lambda strategy, nprocs: {"framework": "recorded", "topology": repr(strategy.topology),
                                                       "final_loss": 0.5, "accuracy": 0.9, "step_time_ms": 1.0})

    @pp.hookimpl
    def polyparallel_register_advisors(self, register):
        from polyparallel._advisor import LayerProfile, ModelProfile

        self.calls.append(("polyparallel_register_advisors", {}))

        class Advisor:
            def profile(self, model, batch, seq_len):
                return ModelProfile(model, "recorded-runtime", [LayerProfile("only", ((400, False),), flops=1e6)])
        register("recorded-runtime", Advisor())

    @pp.hookimpl
    def polyparallel_adapter_bridge(self, adapter, obj):
        if not isinstance(obj, Subject):
            return None
        self.calls.append(("polyparallel_adapter_bridge", {"adapter": adapter, "obj": obj}))
        return ("bridge", adapter, obj)

    @pp.hookimpl(tryfirst=True)
    def polyparallel_process_info(self, strategy):
        self.calls.append(("polyparallel_process_info", {"strategy": strategy}))
        return pp.ProcessInfo(rank=1, world_size=2, local_rank=1)

    @pp.hookimpl
    def polyparallel_session_start(self, session):
        self.calls.append(("polyparallel_session_start", {"session": session}))

    @pp.hookimpl
    def polyparallel_session_finish(self, session):
        self.calls.append(("polyparallel_session_finish", {"session": session}))

    @pp.hookimpl(tryfirst=True)
    def polyparallel_launch(self, fn, strategy, nprocs, args, kwargs, timeout):
        self.calls.append(("polyparallel_launch", {"strategy": strategy, "nprocs": nprocs, "args": args, "timeout": timeout}))
        return [fn(*args, **kwargs) for _ in range(nprocs)]  # in this process: enough to see it used

    @pp.hookimpl(tryfirst=True)
    def polyparallel_launch_script(self, command, options):
        self.calls.append(("polyparallel_launch_script", {"command": command, "options": options}))
        return 7

    def _operation(self, hook: str, subject: Any, **kwargs: Any) -> Any:
        if not isinstance(subject, Subject):
            return None
        self.calls.append((hook, {"subject": subject, **kwargs}))
        return (hook, subject)

    @pp.hookimpl
    def polyparallel_shard_data(self, strategy, session, data, policy):
        return self._operation("polyparallel_shard_data", data, policy=policy, session=session)

    @pp.hookimpl
    def polyparallel_wrap_model(self, strategy, session, model, options):
        return self._operation("polyparallel_wrap_model", model, options=options)

    @pp.hookimpl
    def polyparallel_sync_grads(self, strategy, session, target):
        return self._operation("polyparallel_sync_grads", target)

    @pp.hookimpl
    def polyparallel_reduce_metrics(self, strategy, session, metrics):
        return self._operation("polyparallel_reduce_metrics", metrics.get("m"), metrics=metrics)

    @pp.hookimpl
    def polyparallel_sync_states(self, strategy, session, states):
        return self._operation("polyparallel_sync_states", states)

    @pp.hookimpl
    def polyparallel_save_checkpoint(self, strategy, session, path, state):
        if not isinstance(state.get("model"), Subject):
            return None
        self.calls.append(("polyparallel_save_checkpoint", {"subject": state["model"], "path": path, "state": state,
                                                            "session": session}))
        return path + "!"

    @pp.hookimpl
    def polyparallel_load_checkpoint(self, strategy, session, path, state):
        if not isinstance(state.get("model"), Subject):
            return None
        self.calls.append(("polyparallel_load_checkpoint", {"subject": state["model"], "path": path, "state": state}))
        return {"epoch": 1, "step": 2, "global_step": 9, "note": "restored"}

    @pp.hookimpl
    def polyparallel_export_checkpoint(self, path, metadata, to, output):
        if metadata.get("runtime") != "recorded-runtime":
            return None
        self.calls.append(("polyparallel_export_checkpoint", {"path": path, "to": to, "output": output}))
        Path(output).write_bytes(b"exported")
        return output


#: (strategy on a manager holding the recorder, the recorder, run the CLI on that manager, a temporary folder)
Case = Callable[[pp.Strategy, Recorder, Callable[..., Any], Path], None]


def _adapters(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    assert strategy.adapt("recorded", option=1) == ("adapted", strategy, {"option": 1})
    assert rec.seen("polyparallel_register_adapters")
    listing = json.loads(invoke("plugins", "--json").output)
    assert [p["adapters"] for p in listing if p["name"] == "recorder"] == [["recorded"]]


def _capabilities(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    strategy.replace(data=1).check("recorded-runtime")
    assert rec.seen("polyparallel_capabilities")
    with pytest.raises(pp.UnsupportedTopologyError, match="recorded-runtime"):
        strategy.replace(data=1, tensor=2).check("recorded-runtime")


def _demos(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    result = invoke("demo", "--only", "recorded", "--nprocs", "1", "--json", "--out", str(tmp / "demo"))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["final_loss"] == 0.5  # progress and the summary go to stderr
    assert rec.seen("polyparallel_register_demos")


def _advisors(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    result = invoke("plan", "--model", "recorded:model", "--world", "2", "--batch", "4", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["model"][0]["model"] == "recorded:model" and out["model"][0]["runtime"] == "recorded-runtime"
    assert [(c["data"], c["refused"]) for c in out["candidates"] if c["zero"] == 0][0] == (2, None)
    assert rec.seen("polyparallel_register_advisors")


def _adapter_bridge(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    subject = Subject()
    assert strategy.plugin_manager.bridge("ignite", subject) == ("bridge", "ignite", subject)
    assert strategy.plugin_manager.bridge("ignite", object()) is None  # not the recorder's: no bridge
    assert rec.seen("polyparallel_adapter_bridge") == [{"adapter": "ignite", "obj": subject}]


def _process_info(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    session = strategy.session()
    assert (session.rank, session.world_size) == (1, 2)
    assert rec.seen("polyparallel_process_info") == [{"strategy": strategy}]


def _session_start(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    session = strategy.session()
    assert rec.seen("polyparallel_session_start") == [{"session": session}]


def _session_finish(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    session = strategy.session()
    assert not rec.seen("polyparallel_session_finish")
    session.close()
    assert rec.seen("polyparallel_session_finish") == [{"session": session}]


def _launch(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    assert pp.launch(abs, strategy, 2, args=(-3,), timeout=30) == [3, 3]
    assert rec.seen("polyparallel_launch") == [{"strategy": strategy, "nprocs": 2, "args": (-3,), "timeout": 30}]


def _launch_script(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    script = tmp / "train.py"
    script.write_text("print('hello')\n")
    result = invoke("launch", "--nproc-per-node", "2", str(script), "--lr", "0.1")
    assert result.exit_code == 7, result.output  # the hook's exit code is the command's
    (call,) = rec.seen("polyparallel_launch_script")
    assert call["command"] == [str(script), "--lr", "0.1"] and call["options"]["nproc_per_node"] == "2"


def _save_checkpoint(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    subject = Subject()
    assert strategy.save(tmp / "ckpt", model=subject, lr=0.1, optimizer=None) == str(tmp / "ckpt") + "!"
    (seen,) = rec.seen("polyparallel_save_checkpoint")
    assert seen["path"] == str(tmp / "ckpt") and seen["state"] == {"model": subject, "lr": 0.1}  # None dropped
    assert seen["session"] is strategy.session()
    # An implementation without options= saves synchronously: async_save returns a finished future.
    future = strategy.async_save(tmp / "ckpt", model=subject)
    assert future.done() and future.result() == str(tmp / "ckpt") + "!"


def _load_checkpoint(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    subject, path = Subject(), tmp / "ckpt"
    path.mkdir()
    with pytest.raises(pp.CheckpointError, match="not a committed"):  # no marker: refused before the hook
        strategy.load(path, model=subject)
    assert not rec.seen("polyparallel_load_checkpoint")
    _checkpoints.write_marker(str(path), _checkpoints.base_metadata(strategy, strategy.session(), None))
    assert strategy.load(path, model=subject) == {"epoch": 1, "step": 2, "global_step": 9, "note": "restored"}
    (seen,) = rec.seen("polyparallel_load_checkpoint")
    assert seen["path"] == str(path) and seen["state"] == {"model": subject}


def _export_checkpoint(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
    path = tmp / "ckpt"
    path.mkdir()
    _checkpoints.write_marker(str(path), _checkpoints.base_metadata(strategy, strategy.session(), None))
    result = invoke("checkpoint", "export", str(path), "--to", "safetensors", "-o", str(tmp / "out.st"))
    assert result.exit_code == 0, result.output
    assert rec.seen("polyparallel_export_checkpoint") == [{"path": str(path), "to": "safetensors",
                                                            "output": str(tmp / "out.st")}]
    assert (tmp / "out.st").read_bytes() == b"exported" and "wrote" in result.output


def _operation(name: str, call: Callable[[pp.Strategy, Subject], Any], **expected: Any) -> Case:
    def case(strategy: pp.Strategy, rec: Recorder, invoke: Callable[..., Any], tmp: Path) -> None:
        subject = Subject()
        hook = f"polyparallel_{name}"
        assert call(strategy, subject) == (hook, subject)
        (seen,) = rec.seen(hook)
        assert seen["subject"] is subject
        for key, check in expected.items():
            assert check(seen[key]), (key, seen[key])
    return case


CASES: dict[str, Case] = {
    "polyparallel_register_adapters": _adapters,
    "polyparallel_capabilities": _capabilities,
    "polyparallel_register_demos": _demos,
    "polyparallel_register_advisors": _advisors,
    "polyparallel_adapter_bridge": _adapter_bridge,
    "polyparallel_process_info": _process_info,
    "polyparallel_session_start": _session_start,
    "polyparallel_session_finish": _session_finish,
    "polyparallel_launch": _launch,
    "polyparallel_launch_script": _launch_script,
    "polyparallel_shard_data": _operation("shard_data", lambda s, x: s.shard_data(x, batch_size=4),
                                          policy=lambda p: p.batch_size == 4, session=lambda se: se.rank == 1),
    "polyparallel_wrap_model": _operation("wrap_model", lambda s, x: s.wrap_model(x, plan="p"),
                                          options=lambda o: o == {"plan": "p"}),
    "polyparallel_sync_grads": _operation("sync_grads", lambda s, x: s.sync_grads(x)),
    "polyparallel_reduce_metrics": _operation("reduce_metrics", lambda s, x: s.reduce_metrics({"m": x}),
                                              metrics=lambda m: list(m) == ["m"]),
    "polyparallel_sync_states": _operation("sync_states", lambda s, x: s.sync_states(x)),
    "polyparallel_save_checkpoint": _save_checkpoint,
    "polyparallel_load_checkpoint": _load_checkpoint,
    "polyparallel_export_checkpoint": _export_checkpoint,
}


def test_every_spec_has_a_case_and_the_recorder_implements_it():
    missing = sorted(set(SPECS) - set(CASES))
    assert not missing, f"hook specs without a case proving the core calls them: {missing}; add one to CASES"
    assert set(CASES) <= set(SPECS), f"cases for hooks that no longer exist: {sorted(set(CASES) - set(SPECS))}"
    unimplemented = sorted(name for name in SPECS if not callable(getattr(Recorder, name, None)))
    assert not unimplemented, f"Recorder does not implement {unimplemented}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_core_calls_the_hook(name, manager, monkeypatch, tmp_path):
    rec = Recorder()
    manager.register(rec, name="recorder")
    monkeypatch.setattr(cli_module, "get_plugin_manager", lambda: manager)
    runner = CliRunner()
    invoke = lambda *args: runner.invoke(cli_module.cli, list(args), prog_name="polyparallel")
    strategy = pp.Strategy(data=2, timeout=30, plugin_manager=manager)
    CASES[name](strategy, rec, invoke, tmp_path)
