"""``polyparallel/_routing.py``: which runtime runs a strategy, chosen once, handed to every hook.

Runtimes here are fakes declared through ``polyparallel_capabilities``; "installed" and
"imported" are controlled through the modules they declare in ``imports`` (a module that exists,
one that does not, and fake modules put in ``sys.modules``). The last tests use the real plugins
and a fresh virtual environment with nothing but the core.
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import polyparallel as pp
from polyparallel import _manager, _routing

REPO = Path(__file__).resolve().parents[2]
MISSING = "polyparallel_not_installed_xyz"


class Runtime:
    """A runtime plugin: declares one runtime; its ``shard_data`` answers for every session it is
    given, with no ``session.runtime`` guard (the core routes it only its own runtime's sessions),
    and it records what ``process_info`` was told."""

    def __init__(self, name: str, *, imports: set[str] = frozenset(), backends: set[str] = frozenset(),
                 priority: int = 0, axes: set[str] = frozenset({"data"})):
        self.caps = pp.Capabilities(name, axes=axes, imports=imports, backends=backends, priority=priority)
        self.name = name
        self.told: list[str | None] = []

    @pp.hookimpl
    def polyparallel_capabilities(self):
        return self.caps

    @pp.hookimpl
    def polyparallel_process_info(self, runtime):
        self.told.append(runtime)

    @pp.hookimpl
    def polyparallel_shard_data(self, session, data):
        return f"{self.name} sharded {data}"


@pytest.fixture
def imported(monkeypatch):
    """``imported("fw_a")`` puts a fake top-level module in ``sys.modules`` (its framework is imported)."""
    def put(name: str) -> None:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    return put


def register(pm: pp.PluginManager, *runtimes: Runtime) -> None:
    for runtime in runtimes:
        pm.register(runtime, name=f"{runtime.name}-plugin")


def choice(pm: pp.PluginManager, **kwargs) -> str | None:
    return pp.Strategy(plugin_manager=pm, **kwargs).resolve_runtime()


# -- the automatic choice ------------------------------------------------------------------------------------


def test_the_only_installed_runtime_is_chosen_whatever_the_priorities(manager, imported):
    register(manager, Runtime("low", imports={"json"}, priority=-5), Runtime("high", imports={MISSING}, priority=9))
    assert choice(manager) == "low"


def test_imported_beats_priority_among_installed_runtimes(manager, imported, tmp_path, monkeypatch):
    # Two installed runtimes (their modules can be found), only one of them imported.
    for name in ("fw_one", "fw_two"):
        (tmp_path / f"{name}.py").write_text("")
    monkeypatch.syspath_prepend(tmp_path)
    register(manager, Runtime("one", imports={"fw_one"}, priority=0), Runtime("two", imports={"fw_two"}, priority=9))
    assert choice(manager) == "two"  # neither imported: the higher priority
    imported("fw_one")
    assert choice(_fresh(manager)) == "one"  # the only one whose framework is imported
    imported("fw_two")
    assert choice(_fresh(manager)) == "two"  # both imported: the higher priority again


def _fresh(pm: pp.PluginManager) -> pp.PluginManager:
    """A new manager with the same plugins (the choice is cached per manager)."""
    fresh = pp.PluginManager(autoload=False)
    for info in pm.plugins()[1:]:
        fresh.register(pm._pm.get_plugin(info.name), name=info.name)
    return fresh


@pytest.mark.parametrize("order", [0, 1], ids=["a-first", "b-first"])
def test_never_registration_order(manager, order):
    runtimes = [Runtime("a", priority=1), Runtime("b", priority=2)]
    register(manager, *(runtimes if order == 0 else runtimes[::-1]))
    assert choice(manager) == "b"


def test_a_tie_asks_for_an_explicit_runtime(manager):
    register(manager, Runtime("a", priority=1), Runtime("b", priority=1), Runtime("c", priority=0))
    with pytest.raises(pp.TopologyError, match=r"The runtimes 'a', 'b' are installed, not imported and equally "
                                               r"preferred \(priority 1\): choose one with Strategy\(runtime='a'\)\."):
        choice(manager)
    assert choice(manager, runtime="b") == "b"


def test_a_backend_narrows_the_candidates(manager):
    register(manager, Runtime("ring", backends={"ring", "tree"}, priority=0), Runtime("solo", priority=5))
    assert choice(manager) == "solo"
    assert choice(manager, backend="tree") == "ring"
    with pytest.raises(pp.TopologyError, match=r"Strategy\(backend='mpi'\) is a backend of no installed runtime "
                                               r"\(ring: ring, tree; solo: none \(chooses itself\)\)\. Use one of "
                                               r"those, or backend=None\."):
        choice(manager, backend="mpi")
    with pytest.raises(pp.TopologyError, match=r"Strategy\(backend='solo'\) names a runtime, not a communication "
                                               r"backend\. Choose the runtime with Strategy\(runtime='solo'\)"):
        choice(manager, backend="solo")


def test_no_runtime_at_all(manager):
    assert manager.resolve_runtime(pp.Strategy(plugin_manager=manager)) is None
    assert pp.Strategy(plugin_manager=manager).session().runtime is None  # plugins that are not runtimes still work
    with pytest.raises(pp.NoPluginError, match=r"This strategy needs a runtime, but no runtime is installed\. "
                                               r"Install one: pip install 'polyparallel\[torch\]'\."):
        choice(manager)


def test_runtimes_registered_but_none_installed(manager, monkeypatch):
    monkeypatch.setattr(_routing, "extras", lambda: {"torch", "jax"})
    register(manager, Runtime("torch", imports={MISSING}), Runtime("jax", imports={MISSING + "_jax"}))
    with pytest.raises(pp.NoPluginError, match=(
            rf"No runtime is installed \(jax \(plugin 'jax-plugin'\) needs {MISSING}_jax; torch \(plugin "
            rf"'torch-plugin'\) needs {MISSING}\)\. Install one: pip install 'polyparallel\[torch\]' or pip install "
            r"'polyparallel\[jax\]'\.")):
        pp.Strategy(plugin_manager=manager).reduce_metrics({"loss": 1.0})


# -- an explicit runtime ----------------------------------------------------------------------------------------


def test_an_explicit_runtime_is_used_whatever_the_priorities(manager):
    register(manager, Runtime("a", priority=0), Runtime("b", priority=9))
    assert choice(manager, runtime="a") == "a"


@pytest.mark.parametrize(("runtime", "message"), [
    ("tpu", r"Strategy\(runtime='tpu'\) names the runtime 'tpu', which no installed plugin provides\. Runtimes: "
            r"absent, ring\. Install it: install the plugin that provides 'tpu' \(see `polyparallel plugins`\)\."),
    ("absent", rf"Strategy\(runtime='absent'\): the runtime 'absent' \(plugin 'absent-plugin'\) needs {MISSING}, "
               rf"which is not installed\. Install it: pip install {MISSING}\."),
])
def test_an_explicit_runtime_must_be_installed(manager, runtime, message):
    register(manager, Runtime("ring", backends={"ring"}), Runtime("absent", imports={MISSING}))
    with pytest.raises(pp.NoPluginError, match=message):
        choice(manager, runtime=runtime)


def test_an_explicit_runtime_checks_the_backend(manager):
    register(manager, Runtime("ring", backends={"ring", "tree"}), Runtime("solo"))
    assert choice(manager, runtime="ring", backend="tree") == "ring"
    with pytest.raises(pp.TopologyError, match=r"Strategy\(backend='nccl'\) is not a backend of the runtime 'ring' "
                                               r"\(plugin 'ring-plugin'\): it accepts 'ring', 'tree'\. Use one of them, "
                                               r"or backend=None to let the runtime choose\."):
        choice(manager, runtime="ring", backend="nccl")
    with pytest.raises(pp.TopologyError, match=r"not a backend of the runtime 'solo' .*: it has no backend to choose, "
                                               r"so backend must be None\."):
        choice(manager, runtime="solo", backend="tree")


# -- once per process and strategy; carried into launched processes -----------------------------------------------


def test_the_choice_is_made_once_per_strategy_and_redone_when_plugins_change(manager, monkeypatch):
    register(manager, Runtime("a", priority=1))
    calls = []
    original = _routing.choose
    monkeypatch.setattr(_routing, "choose", lambda *args: calls.append(args[1]) or original(*args))
    s = pp.Strategy(plugin_manager=manager)
    for _ in range(3):
        assert s.resolve_runtime() == "a" and s.session().runtime == "a"
        s.shard_data("x")
    assert s.replace().resolve_runtime() == "a"  # an equal value: the same choice
    assert len(calls) == 1
    register(manager, Runtime("b", priority=2))
    assert s.resolve_runtime() == "b" and len(calls) == 2


def test_a_pickled_strategy_carries_the_choice_into_another_process(manager, monkeypatch):
    a, b = Runtime("a", priority=1), Runtime("b", priority=2)
    register(manager, a)  # the parent has only a
    s = pp.Strategy(plugin_manager=manager)
    assert s.resolve_runtime() == "a"
    child_pm = pp.PluginManager(autoload=False)  # the "child" would choose b by itself
    register(child_pm, a, b)
    monkeypatch.setattr(_manager, "_default", child_pm)
    clone = pickle.loads(pickle.dumps(s))
    assert clone == s and clone.plugin_manager is child_pm
    assert clone.resolve_runtime() == "a" and clone.session().runtime == "a"
    assert pp.Strategy(data=3).resolve_runtime() == "b"  # another strategy made in the child chooses there
    assert pickle.loads(pickle.dumps(pp.Strategy(data=5)))._runtime_hint is None  # nothing chosen: nothing carried


# -- sessions: the runtime reaches the hooks; capabilities checked before any group ------------------------------


def test_a_runtime_plugin_sees_only_its_own_runtimes_sessions(manager):
    # Neither fake runtime guards on session.runtime: the core calls each one's hooks for its own
    # sessions only (the first would otherwise answer every shard_data call).
    a, b = Runtime("a", priority=1), Runtime("b", priority=2)
    register(manager, a, b)
    assert pp.Strategy(plugin_manager=manager).shard_data("data") == "b sharded data"
    assert pp.Strategy(runtime="a", plugin_manager=manager).shard_data("data") == "a sharded data"
    assert pp.Strategy(runtime="b", plugin_manager=manager, seed=1).shard_data("data") == "b sharded data"
    assert a.told == ["a"] and b.told == ["b", "b"]  # process_info too is asked only for its own runtime


class Observer:
    """A plugin that is no runtime's: declares nothing, or adapters for some runtimes; records the
    runtime of every session its hooks see, and wraps shard_data."""

    def __init__(self, adapter_runtimes=None):
        self.adapter_runtimes, self.seen, self.wrapped = adapter_runtimes, [], []

    @pp.hookimpl
    def polyparallel_register_adapters(self, register):
        if self.adapter_runtimes is not None:
            register(f"adapter-{id(self)}", object, capabilities=pp.Capabilities("x", runtimes=self.adapter_runtimes))

    @pp.hookimpl
    def polyparallel_session_start(self, session):
        self.seen.append(session.runtime)

    @pp.hookimpl(wrapper=True)
    def polyparallel_shard_data(self, session):
        self.wrapped.append(session.runtime)
        return (yield)


def test_adapters_see_the_runtimes_they_run_on_and_other_plugins_every_session(manager):
    a, b = Runtime("a", priority=1), Runtime("b", priority=2)
    anywhere, on_a, on_any_adapter = Observer(), Observer({"a"}), Observer(set())
    register(manager, a, b)
    for name, plugin in (("anywhere", anywhere), ("on-a", on_a), ("any-adapter", on_any_adapter)):
        manager.register(plugin, name=name)
    assert manager.served_runtimes() == {"polyparallel.core": None, "a-plugin": {"a"}, "b-plugin": {"b"},
                                         "anywhere": None, "on-a": {"a"}, "any-adapter": None}
    for runtime in ("a", "b"):
        assert pp.Strategy(runtime=runtime, plugin_manager=manager).shard_data("d") == f"{runtime} sharded d"
    assert anywhere.seen == ["a", "b"] and on_any_adapter.seen == ["a", "b"] and on_a.seen == ["a"]
    assert anywhere.wrapped == ["a", "b"] and on_a.wrapped == ["a"]  # wrappers are routed the same way


def test_routes_are_rebuilt_when_plugins_change(manager):
    a = Runtime("a", priority=1)
    register(manager, a)
    assert pp.Strategy(plugin_manager=manager).shard_data("d") == "a sharded d"
    b = Runtime("b", priority=2)
    register(manager, b)
    assert pp.Strategy(plugin_manager=manager, seed=2).shard_data("d") == "b sharded d"
    manager.unregister("b-plugin")
    assert pp.Strategy(plugin_manager=manager, seed=3).shard_data("d") == "a sharded d"


def test_session_creation_checks_the_runtime_capabilities_first(manager, monkeypatch):
    started = []

    class Observer:
        @pp.hookimpl
        def polyparallel_session_start(self, session):
            started.append(session)

    register(manager, Runtime("dataonly", axes={"data"}))
    manager.register(Observer(), name="observer")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")  # as under torchrun: the script built its own Strategy
    s = pp.Strategy(tensor=2, plugin_manager=manager)
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'dataonly' \(plugin 'dataonly-plugin'\) cannot run "
                                                          r"tensor=2"):
        s.shard_data("data")
    with pytest.raises(pp.TopologyError, match=r"in a world of 4: the global batch size 6 does not divide over "
                                               r"data=4 ranks"):
        pp.Strategy(batch_size=6, plugin_manager=manager).session()
    assert started == [] and manager.sessions() == []


def test_shard_data_overrides_are_checked_before_dispatch(manager, monkeypatch):
    register(manager, Runtime("a"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    s = pp.Strategy(plugin_manager=manager)
    with pytest.raises(pp.TopologyError, match=r"shard_data\(\): the global batch size 6 does not divide over data=4"):
        s.shard_data("data", batch_size=6)
    with pytest.raises(TypeError, match=r"shard_data\(\) got unknown option\(s\) shufle; the options are the "
                                        r"DataPolicy fields: batch_size, shuffle, remainder\."):
        s.shard_data("data", shufle=False)
    assert s.shard_data("data", batch_size=8) == "a sharded data"


# -- nobody answered: the message says what to do --------------------------------------------------------------------


def test_an_object_of_another_runtimes_framework(manager, imported):
    imported("fw_b")
    register(manager, Runtime("a", priority=1), Runtime("b", imports={"fw_b"}, priority=0))
    array = type("Array", (), {"__module__": "fw_b.core"})()
    with pytest.raises(pp.NoPluginError, match=r"for an object of type fw_b\.core\.Array on the 'a' runtime\. .*fw_b "
                                               r"objects belong to the 'b' runtime, but this strategy runs on 'a': use "
                                               r"Strategy\(runtime='b'\)\."):
        pp.Strategy(runtime="a", plugin_manager=manager).sync_states(array)
    with pytest.raises(pp.NoPluginError, match=r"for metrics with values of type builtins\.float, fw_b\.core\.Array "
                                               r"on the 'a' runtime\..*use Strategy\(runtime='b'\)"):
        pp.Strategy(runtime="a", plugin_manager=manager).reduce_metrics({"x": 1.0, "y": array})


# -- the real plugins -----------------------------------------------------------------------------------------------


def test_the_framework_adapters_refuse_a_strategy_on_another_runtime():
    # The real entry points: lightning and ignite declare that they run on torch.
    for adapter in ("lightning", "ignite"):
        with pytest.raises(pp.UnsupportedTopologyError, match=(
                rf"The adapter '{adapter}' \(plugin '{adapter}'\) runs on the 'torch' runtime, but this strategy's "
                r"runtime is 'jax' \(Strategy\(runtime='jax'\)\)\. Use Strategy\(runtime='torch'\)")):
            pp.Strategy(runtime="jax").adapt(adapter)
    with pytest.raises(pp.UnsupportedTopologyError, match=r"The adapter 'jax' .* runs on the 'jax' runtime, but this "
                                                          r"strategy's runtime is 'torch'"):
        pp.Strategy(runtime="torch").adapt("jax")


def test_the_real_runtimes_declare_what_they_need():
    runtimes = pp.get_plugin_manager().runtimes()
    assert (runtimes["torch"].imports, runtimes["torch"].backends) == ({"torch"}, {"gloo", "nccl"})
    assert (runtimes["jax"].imports, runtimes["jax"].backends) == ({"jax", "jaxlib"}, frozenset())
    assert runtimes["torch"].priority > runtimes["jax"].priority
    with pytest.raises(pp.TopologyError, match=r"Strategy\(backend='mpi'\) is not a backend of the runtime 'torch'"):
        pp.Strategy(runtime="torch", backend="mpi").check()
    with pytest.raises(pp.TopologyError, match=r"it has no backend to choose, so backend must be None"):
        pp.Strategy(runtime="jax", backend="gloo").check()


CORE_ONLY_PROBE = r"""
import json, sys
import polyparallel as pp

def train():
    return 1

out = {"frameworks": sorted(m for m in ("torch", "jax") if m in sys.modules)}
for name, call in [("reduce_metrics", lambda: pp.Strategy().reduce_metrics({"loss": 1.0})),
                   ("launch", lambda: pp.launch(train, pp.Strategy(), 2)),
                   ("runtime", lambda: pp.Strategy(runtime="torch").session())]:
    try:
        call()
        out[name] = "no error"
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_a_core_only_install_says_which_runtime_to_install(tmp_path):
    """A fresh virtual environment with the project (whose wheel registers the torch and JAX
    plugins' entry points) and its two dependencies, without torch or JAX."""
    import json

    source = tmp_path / "src"
    for part in ("polyparallel", "plugins"):
        shutil.copytree(REPO / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / part, source / part)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no PYTHONPATH: only what is installed
    for args in (["pluggy", "click"], ["--no-deps", str(source)]):
        done = subprocess.run([python, "-m", "pip", "install", "-q", *args], capture_output=True, text=True,
                              timeout=240, env={**env, **_pip_env()})
        assert done.returncode == 0, done.stderr
    result = subprocess.run([python, "-c", CORE_ONLY_PROBE], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["frameworks"] == []
    assert out["reduce_metrics"].startswith("NoPluginError: No polyparallel plugin handles reduce_metrics")
    assert out["launch"].startswith("NoPluginError: launch() needs a runtime, but no runtime is installed")
    assert out["runtime"] == ("NoPluginError: Strategy(runtime='torch'): the runtime 'torch' (plugin 'torch') needs "
                              "torch, which is not installed. Install it: pip install 'polyparallel[torch]'.")
    for name in ("reduce_metrics", "launch"):
        assert "pip install 'polyparallel[torch]'" in out[name], out[name]
        assert "No module named" not in out[name]


def _pip_env() -> dict[str, str]:
    """pip's own configuration (a local index here) from this environment."""
    import os

    return {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
