"""``polyparallel/_manager.py``: lazy, idempotent entry-point loading and error-translating dispatch.

Installed distributions are faked by monkeypatching ``importlib.metadata.distributions`` (the
``fake_install`` fixture), as pluggy's own tests do; nothing is installed.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import types
import warnings

import pluggy
import pytest

import polyparallel as pp
from polyparallel import _routing
from polyparallel._manager import DISABLE_AUTOLOAD_ENV, PLUGINS_ENV, PluginInfo


class Tagged:
    """A data object owned by the plugin whose tag it carries."""

    def __init__(self, owner: str):
        self.owner = owner


class Owner:
    """Answers ``shard_data`` for :class:`Tagged` objects carrying its tag, ``None`` otherwise."""

    def __init__(self, tag: str):
        self.tag = tag

    @pp.hookimpl
    def polyparallel_shard_data(self, data):
        if isinstance(data, Tagged) and data.owner in (self.tag, "anyone"):
            return f"sharded by {self.tag}"
        return None


class Faulty:
    """A plugin whose hook raises ``error`` (through a helper, as real code would)."""

    def __init__(self, error: BaseException):
        self.error = error

    def _helper(self) -> None:
        raise self.error

    @pp.hookimpl
    def polyparallel_shard_data(self, data):
        self._helper()


def strategy(pm: pp.PluginManager) -> pp.Strategy:
    return pp.Strategy(plugin_manager=pm)


def names(pm: pp.PluginManager) -> list[str]:
    return [info.name for info in pm.plugins()]


# -- lazy, idempotent loading ----------------------------------------------------------------------------


def test_nothing_is_loaded_before_first_use(fake_install):
    ep = fake_install.add("alpha", Owner("alpha"))
    pm = pp.PluginManager()
    # Registering, blocking and asking about blocks are not "use".
    pm.register(Owner("local"), name="local")
    pm.set_blocked("unwanted")
    assert pm.is_blocked("unwanted")
    assert (fake_install.scans, ep.loads) == (0, 0)
    _ = pm.hook  # first use
    assert (fake_install.scans, ep.loads) == (1, 1)
    assert strategy(pm).shard_data(Tagged("alpha")) == "sharded by alpha"


def test_listing_plugins_loads_them(fake_install):
    ep = fake_install.add("alpha", Owner("alpha"))
    pm = pp.PluginManager()
    assert ep.loads == 0
    assert names(pm) == ["polyparallel.core", "alpha"]
    assert ep.loads == 1


def test_loading_is_idempotent(fake_install):
    ep = fake_install.add("alpha", Owner("alpha"))
    pm = pp.PluginManager()
    for _ in range(3):
        _ = pm.hook
        pm.load()
        pm.plugins()
        pm.adapters()
        pm.capabilities()
        strategy(pm).shard_data(Tagged("alpha"))
    assert (fake_install.scans, ep.loads) == (1, 1)
    assert names(pm) == ["polyparallel.core", "alpha"]


def test_concurrent_first_use_loads_once_and_waits_for_it(fake_install):
    def slow_import():
        time.sleep(0.05)
        return Owner("alpha")
    ep = fake_install.add("alpha", None)
    ep._load = slow_import
    pm = pp.PluginManager()
    answers, errors = [], []

    def first_use():
        try:  # call() takes no lock of its own: only load() can make this thread wait
            answers.append(pm.call("polyparallel_shard_data", strategy=None, session=None, data=Tagged("alpha"),
                                   policy=None))
        except Exception as exc:  # a thread that did not wait for the load sees no plugin
            errors.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and answers == ["sharded by alpha"] * 8  # None: answered before alpha was loaded
    assert ep.loads == 1 and fake_install.scans == 1
    assert names(pm) == ["polyparallel.core", "alpha"]


def test_a_plugin_using_the_manager_while_it_is_imported(fake_install):
    # The entry point's import reaches back into the manager that is loading it (same thread).
    pm = pp.PluginManager()

    def reentrant_import():
        _ = pm.hook.polyparallel_shard_data  # must not recurse into a second load
        return Owner("alpha")
    ep = fake_install.add("alpha", None)
    ep._load = reentrant_import
    assert names(pm) == ["polyparallel.core", "alpha"] and ep.loads == 1


def test_only_the_polyparallel_group_is_loaded(fake_install):
    other = fake_install.add("alpha", Owner("alpha"), group="pytest11")
    pm = pp.PluginManager()
    assert names(pm) == ["polyparallel.core"] and other.loads == 0


def test_plugin_info_names_the_distribution(fake_install):
    fake_install.add("alpha", Owner("alpha"), dist="polyparallel-alpha", version="2.3.1")
    pm = pp.PluginManager()
    info = pm.plugins()[1]
    assert info == PluginInfo("alpha", __name__, "polyparallel-alpha", "2.3.1", ("polyparallel_shard_data",))


def test_core_plugin_comes_first_and_implements_process_info(manager):
    (core,) = manager.plugins()
    assert core.name == "polyparallel.core" and core.dist is None
    assert core.hooks == ("polyparallel_process_info",)


def test_autoload_false_reads_no_entry_point_and_no_environment(fake_install, monkeypatch):
    ep = fake_install.add("alpha", Owner("alpha"))
    monkeypatch.setenv(PLUGINS_ENV, "alpha,not_a_module")
    pm = pp.PluginManager(autoload=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "neither an entry point nor a module" warning either
        assert names(pm) == ["polyparallel.core"]
    assert (fake_install.scans, ep.loads) == (0, 0)


# -- a broken plugin does not break the others -----------------------------------------------------------


@pytest.mark.parametrize(("error", "shown"), [
    (ImportError("No module named 'missing_dependency'"), "ImportError: No module named 'missing_dependency'"),
    (AttributeError("module has no attribute 'hookimpl'"), "AttributeError: module has no attribute 'hookimpl'"),
])
def test_a_broken_entry_point_is_skipped_with_a_warning(fake_install, error, shown):
    fake_install.add("alpha", Owner("alpha"))
    broken = fake_install.add("broken", error, dist="polyparallel-broken")
    fake_install.add("omega", Owner("omega"))
    pm = pp.PluginManager()
    with pytest.warns(RuntimeWarning, match=rf"polyparallel: skipping plugin 'broken' \(fake_broken_module\) "
                                            rf"from polyparallel-broken: {shown}") as record:
        assert names(pm) == ["polyparallel.core", "alpha", "omega"]
    assert len(record) == 1 and broken.loads == 1
    assert strategy(pm).shard_data(Tagged("omega")) == "sharded by omega"
    assert strategy(pm).shard_data(Tagged("alpha")) == "sharded by alpha"


def test_a_plugin_that_fails_validation_is_skipped_with_a_warning(fake_install):
    class WrongArguments:
        @pp.hookimpl
        def polyparallel_shard_data(self, data, no_such_argument):
            return "never"

    fake_install.add("alpha", Owner("alpha"))
    fake_install.add("invalid", WrongArguments())
    pm = pp.PluginManager()
    with pytest.warns(RuntimeWarning, match=r"(?s)skipping plugin 'invalid' .*PluginValidationError.*no_such_argument"):
        assert names(pm) == ["polyparallel.core", "alpha"]
    # Nothing of it was half-registered.
    assert [i.plugin_name for i in pm.hook.polyparallel_shard_data.get_hookimpls()] == ["alpha"]


# -- the environment switches ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", "yes", " TRUE "])
def test_disable_autoload_loads_none(fake_install, monkeypatch, value):
    eps = [fake_install.add(name, Owner(name)) for name in ("a", "b", "c")]
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, value)
    pm = pp.PluginManager()
    assert names(pm) == ["polyparallel.core"]
    assert [ep.loads for ep in eps] == [0, 0, 0]
    with pytest.raises(pp.NoPluginError):
        strategy(pm).shard_data(Tagged("a"))


@pytest.mark.parametrize("value", ["", "0", "false", "no", "No"])
def test_falsy_disable_values_keep_autoload(fake_install, monkeypatch, value):
    fake_install.add("a", Owner("a"))
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, value)
    assert names(pp.PluginManager()) == ["polyparallel.core", "a"]


def test_disable_autoload_keeps_the_named_plugins(fake_install, monkeypatch):
    eps = {name: fake_install.add(name, Owner(name)) for name in ("a", "b", "c")}
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    monkeypatch.setenv(PLUGINS_ENV, " a , c,")
    pm = pp.PluginManager()
    assert names(pm) == ["polyparallel.core", "a", "c"]
    assert eps["b"].loads == 0
    assert strategy(pm).shard_data(Tagged("c")) == "sharded by c"


def test_plugins_env_also_takes_module_names(fake_install, monkeypatch):
    module = types.ModuleType("my_local_plugin")
    module.polyparallel_shard_data = pp.hookimpl(lambda data: "sharded by module" if isinstance(data, Tagged) else None)
    monkeypatch.setitem(sys.modules, "my_local_plugin", module)
    fake_install.add("a", Owner("a"))
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    monkeypatch.setenv(PLUGINS_ENV, "my_local_plugin")
    pm = pp.PluginManager()
    assert names(pm) == ["polyparallel.core", "my_local_plugin"]
    assert pm.plugins()[1].module == "my_local_plugin"
    assert strategy(pm).shard_data(Tagged("x")) == "sharded by module"


def test_plugins_env_with_an_unknown_name_warns(fake_install, monkeypatch):
    fake_install.add("a", Owner("a"))
    monkeypatch.setenv(PLUGINS_ENV, "a,no_such_plugin_xyz")
    pm = pp.PluginManager()
    with pytest.warns(RuntimeWarning, match=r"POLYPARALLEL_PLUGINS names 'no_such_plugin_xyz', which is neither an "
                                            r"entry point nor an importable plugin module"):
        assert names(pm) == ["polyparallel.core", "a"]


def test_plugins_env_names_a_module_that_fails_to_import(fake_install, monkeypatch, tmp_path):
    (tmp_path / "exploding_plugin_xyz.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.setenv(PLUGINS_ENV, "exploding_plugin_xyz")
    pm = pp.PluginManager()
    with pytest.warns(RuntimeWarning, match=r"'exploding_plugin_xyz'.*RuntimeError: boom at import"):
        assert names(pm) == ["polyparallel.core"]


# -- blocking -----------------------------------------------------------------------------------------------


def test_a_blocked_entry_point_is_neither_imported_nor_registered(fake_install):
    blocked = fake_install.add("blocked", ImportError("importing me is what is broken"))
    fake_install.add("alpha", Owner("alpha"))
    pm = pp.PluginManager()
    pm.set_blocked("blocked")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert names(pm) == ["polyparallel.core", "alpha"]
    assert blocked.loads == 0 and pm.is_blocked("blocked")


def test_blocking_a_loaded_plugin_unregisters_it(fake_install):
    fake_install.add("alpha", Owner("alpha"))
    pm = pp.PluginManager()
    assert strategy(pm).shard_data(Tagged("alpha")) == "sharded by alpha"
    pm.set_blocked("alpha")
    assert names(pm) == ["polyparallel.core"]
    with pytest.raises(pp.NoPluginError):
        strategy(pm).shard_data(Tagged("alpha"))


def test_register_skips_a_blocked_name_silently(manager):
    manager.set_blocked("records")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert manager.register(Owner("records"), name="records") is None
    assert names(manager) == ["polyparallel.core"]
    assert manager.hook.polyparallel_shard_data.get_hookimpls() == []


def test_a_blocked_name_in_plugins_env_is_not_imported(fake_install, monkeypatch):
    module = types.ModuleType("blocked_module_xyz")
    module.polyparallel_shard_data = pp.hookimpl(lambda data: "never")
    monkeypatch.setitem(sys.modules, "blocked_module_xyz", module)
    monkeypatch.setenv(PLUGINS_ENV, "blocked_module_xyz")
    pm = pp.PluginManager()
    pm.set_blocked("blocked_module_xyz")
    assert names(pm) == ["polyparallel.core"]


def test_register_returns_the_name_and_unregister_removes(manager):
    assert manager.register(Owner("a"), name="a") == "a"
    assert manager.register(Owner("b")) is not None  # pluggy's canonical name
    manager.unregister("a")
    assert "a" not in names(manager)
    manager.unregister("never-registered")  # a no-op


def test_register_a_class_records_its_module(manager):
    class ClassPlugin:
        @staticmethod
        @pp.hookimpl
        def polyparallel_capabilities():
            return pp.Capabilities("classruntime")

    manager.register(ClassPlugin, name="as-class")
    assert manager.plugins()[-1].module == __name__
    assert manager.capabilities()["classruntime"].plugin == "as-class"


# -- dispatch and errors ---------------------------------------------------------------------------------


def test_first_answer_wins_and_none_means_not_mine(manager):
    manager.register(Owner("early"), name="early")
    manager.register(Owner("late"), name="late")
    assert strategy(manager).shard_data(Tagged("early")) == "sharded by early"  # late returned None
    assert strategy(manager).shard_data(Tagged("anyone")) == "sharded by late"  # later registered: asked first


def test_tryfirst_beats_registration_order(manager):
    class Eager(Owner):
        @pp.hookimpl(tryfirst=True)
        def polyparallel_shard_data(self, data):
            return super().polyparallel_shard_data(data)

    manager.register(Eager("eager"), name="eager")
    manager.register(Owner("late"), name="late")
    assert strategy(manager).shard_data(Tagged("anyone")) == "sharded by eager"


def test_a_wrapper_sees_every_operation(manager):
    seen = []

    class Tracer:
        @pp.hookimpl(wrapper=True, tryfirst=True)
        def polyparallel_shard_data(self, data):
            result = yield
            seen.append((data.owner, result))
            return result

    manager.register(Owner("alpha"), name="alpha")
    manager.register(Tracer(), name="tracer")
    assert strategy(manager).shard_data(Tagged("alpha")) == "sharded by alpha"
    assert seen == [("alpha", "sharded by alpha")]


def test_nobody_answered_lists_plugins_and_the_extra(manager, monkeypatch):
    monkeypatch.setattr(_routing, "extras", lambda: {"torch", "jax", "all"})
    manager.register(Owner("alpha"), name="alpha", dist="polyparallel-alpha", version="0.3")
    manager.register(Owner("beta"), name="beta")
    tensor_type = type("Tensor", (), {"__module__": "torch.nn.parameter"})
    with pytest.raises(pp.NoPluginError, match=(
            r"No polyparallel plugin handles shard_data for an object of type torch\.nn\.parameter\.Tensor\. "
            rf"Installed plugins: alpha \(polyparallel-alpha 0\.3\), beta \({__name__}\)\. "
            r"To handle torch objects: pip install 'polyparallel\[torch\]'\.")):
        strategy(manager).shard_data(tensor_type())
    other_type = type("Frame", (), {"__module__": "mylib.frames"})
    with pytest.raises(pp.NoPluginError, match=r"Install a plugin for mylib objects \(extras: all, jax, torch\), "
                                               r"or write one \(CONTRIBUTING\.md\)\."):
        strategy(manager).sync_states(other_type())


def test_nobody_answered_with_no_plugin(manager):
    with pytest.raises(pp.NoPluginError, match=r"for an object of type builtins\.list holding values of type builtins\.int\. "
                                               r"Installed plugins: "
                                               r"none\. No runtime is installed\. Install one: pip install "
                                               r"'polyparallel\[torch\]'\."):
        strategy(manager).shard_data([1, 2, 3])


def test_nobody_answered_is_a_type_error(manager):
    with pytest.raises(TypeError):
        strategy(manager).wrap_model(object())


def test_extras_come_from_the_installed_metadata():
    assert "torch" in _routing.extras()


def test_a_plugin_exception_is_re_raised_naming_the_plugin(manager):
    original = ZeroDivisionError("division by zero in the sampler")
    manager.register(Owner("first"), name="first")  # asked first, returns None
    manager.register(Faulty(original), name="faulty")
    manager.register(Owner("last"), name="last")  # never asked: the error stops the call
    with pytest.raises(pp.PluginError, match=r"plugin 'faulty' failed in polyparallel_shard_data: "
                                             r"ZeroDivisionError: division by zero in the sampler") as info:
        strategy(manager).shard_data(Tagged("first-is-not-me"))
    assert (info.value.plugin, info.value.hook, info.value.error) == ("faulty", "polyparallel_shard_data", original)
    assert info.value.__cause__ is original


def test_polyparallel_errors_keep_their_type_with_a_note(manager):
    original = pp.TopologyError("tensor=3 does not divide 8 attention heads")
    manager.register(Faulty(original), name="faulty")
    with pytest.raises(pp.TopologyError, match="attention heads") as info:
        strategy(manager).shard_data(Tagged("x"))
    assert info.value is original
    assert info.value.__notes__ == ["raised by plugin 'faulty' in polyparallel_shard_data"]


def test_an_error_of_the_caller_is_not_blamed_on_a_plugin(manager):
    manager.register(Owner("alpha"), name="alpha")
    with pytest.raises(pluggy.HookCallError), pytest.warns(UserWarning, match="cannot be found in this hook call"):
        manager.call("polyparallel_shard_data")  # the hook call itself lacks `data`


# -- adapters and capabilities ---------------------------------------------------------------------------------


def factory(strategy, **kwargs):
    return ("built", kwargs)


class Adapters:
    def __init__(self, *names: str, calls: list | None = None):
        self.names, self.calls = names, calls if calls is not None else []

    @pp.hookimpl
    def polyparallel_register_adapters(self, register):
        self.calls.append(1)
        for name in self.names:
            register(name, factory, capabilities=pp.Capabilities(name, axes={"data", "tensor"}),
                     description=f"{name} adapter")


def test_adapters_are_registered_through_the_callback(manager):
    manager.register(Adapters("lightning", "ignite"), name="frameworks")

    class Minimal:
        @pp.hookimpl
        def polyparallel_register_adapters(self, register):
            register("fastai", factory)  # capabilities default to data parallel only

    manager.register(Minimal(), name="minimal")
    adapters = manager.adapters()
    assert sorted(adapters) == ["fastai", "ignite", "lightning"]
    lightning = adapters["lightning"]
    assert (lightning.name, lightning.factory, lightning.plugin, lightning.description) == (
        "lightning", factory, "frameworks", "lightning adapter")
    assert lightning.capabilities == pp.Capabilities("lightning", {"data", "tensor"}, plugin="frameworks")
    assert adapters["fastai"].capabilities == pp.Capabilities("fastai", {"data"}, plugin="minimal")


def test_adapters_are_collected_once_until_plugins_change(manager):
    calls: list = []
    manager.register(Adapters("lightning", calls=calls), name="frameworks")
    manager.adapters()
    manager.adapters()["lightning"] = None  # a copy: the registry is untouched
    assert calls == [1] and manager.adapters()["lightning"].factory is factory
    manager.register(Adapters("ignite"), name="more")
    assert sorted(manager.adapters()) == ["ignite", "lightning"] and calls == [1, 1]
    manager.unregister("more")
    assert sorted(manager.adapters()) == ["lightning"]
    manager.set_blocked("frameworks")
    assert manager.adapters() == {}


def test_an_impl_may_take_no_register_argument(manager):
    class NoArgs:
        @pp.hookimpl
        def polyparallel_register_adapters(self):
            pass

    manager.register(NoArgs(), name="noargs")
    assert manager.adapters() == {}


def test_adapter_precedence_follows_the_call_order(manager):
    manager.register(Adapters("lightning"), name="builtin")
    manager.register(Adapters("lightning"), name="third-party")
    assert manager.adapters()["lightning"].plugin == "third-party"  # registered later: called first

    class Preferred(Adapters):
        @pp.hookimpl(tryfirst=True)
        def polyparallel_register_adapters(self, register):
            super().polyparallel_register_adapters(register)

    manager.register(Preferred("lightning"), name="preferred")
    manager.register(Adapters("lightning"), name="latest")
    assert manager.adapters()["lightning"].plugin == "preferred"


def test_a_failing_adapter_registry_names_the_plugin_and_is_retried(manager):
    attempts = []

    class Flaky:
        @pp.hookimpl
        def polyparallel_register_adapters(self, register):
            attempts.append(1)
            register("early", factory)
            if len(attempts) == 1:
                raise KeyError("config")
            register("late", factory)

    manager.register(Adapters("lightning"), name="frameworks")
    manager.register(Flaky(), name="flaky")
    with pytest.raises(pp.PluginError, match=r"plugin 'flaky' failed in polyparallel_register_adapters: KeyError"):
        manager.adapters()
    # Not left half-collected: the next call asks again and gets everything.
    assert sorted(manager.adapters()) == ["early", "late", "lightning"]


def test_capabilities_of_runtimes_and_adapters(manager):
    class Runtimes:
        @pp.hookimpl
        def polyparallel_capabilities(self):
            return [pp.Capabilities("torch", axes={"data", "tensor", "pipeline"}, features={"no_sync"}),
                    pp.Capabilities("xla", axes={"data"})]

    class OneRuntime:
        @pp.hookimpl
        def polyparallel_capabilities(self):
            return pp.Capabilities("jax", axes={"data", "tensor"}, plugin="ignored: filled by the manager")

    class NoRuntime:
        @pp.hookimpl
        def polyparallel_capabilities(self):
            return None

    manager.register(Runtimes(), name="runtimes")
    manager.register(OneRuntime(), name="jax-plugin")
    manager.register(NoRuntime(), name="none")
    manager.register(Adapters("lightning"), name="frameworks")
    caps = manager.capabilities()
    assert sorted(caps) == ["jax", "lightning", "torch", "xla"]
    assert caps["torch"] == pp.Capabilities("torch", {"data", "tensor", "pipeline"}, {"no_sync"}, "runtimes")
    assert caps["jax"].plugin == "jax-plugin"
    assert caps["lightning"].plugin == "frameworks"


def test_a_failing_capabilities_hook_names_the_plugin(manager):
    class Broken:
        @pp.hookimpl
        def polyparallel_capabilities(self):
            return pp.Capabilities("x", axes={"expert"})

    manager.register(Broken(), name="broken")
    with pytest.raises(pp.PluginError, match=r"plugin 'broken' failed in polyparallel_capabilities: ValueError: "
                                             r"Capabilities\('x'\) names unknown axes \['expert'\]"):
        manager.capabilities()


# -- the process's default manager ------------------------------------------------------------------------------


def test_default_manager_is_one_per_process_and_lazy(fake_install):
    fake_install.add("alpha", Owner("alpha"))
    pm = pp.get_plugin_manager()
    assert pp.get_plugin_manager() is pm
    assert fake_install.scans == 0
    assert "alpha" in names(pm)


# -- registry hooks go through pluggy: wrappers see them -----------------------------------------------------------


def test_hook_wrappers_around_registry_hooks_see_each_plugins_call(manager):
    seen: list[tuple[str, object]] = []

    class Tracer:
        @pp.hookimpl(wrapper=True)
        def polyparallel_capabilities(self):
            result = yield
            seen.append(("capabilities", result))
            return result

        @pp.hookimpl(hookwrapper=True)  # the old-style wrapper too
        def polyparallel_register_adapters(self, register):
            seen.append(("adapters", register))
            yield

    class OneRuntime:
        @pp.hookimpl
        def polyparallel_capabilities(self):
            return pp.Capabilities("rt-a", axes={"data", "tensor"})

    class OtherRuntime:
        @pp.hookimpl
        def polyparallel_capabilities(self):
            return [pp.Capabilities("rt-b")]

    manager.register(Tracer(), name="tracer")
    manager.register(OneRuntime(), name="one")
    manager.register(OtherRuntime(), name="other")
    manager.register(Adapters("lightning"), name="frameworks")
    caps = manager.capabilities()
    # Each declaration is still attributed to the plugin that made it, and the wrapper ran per plugin.
    assert (caps["rt-a"].plugin, caps["rt-b"].plugin, caps["lightning"].plugin) == ("one", "other", "frameworks")
    assert sorted(str(r) for kind, r in seen if kind == "capabilities") == sorted(
        [str([pp.Capabilities("rt-a", axes={"data", "tensor"})]), str([[pp.Capabilities("rt-b")]])])
    assert [kind for kind, _ in seen].count("adapters") == 1  # one adapter-registering plugin: one call
    assert manager.adapters()["lightning"].plugin == "frameworks"


def test_a_wrapper_can_change_what_a_registry_hook_returns(manager):
    class Narrow:
        @pp.hookimpl(wrapper=True)
        def polyparallel_capabilities(self):
            result = yield
            return [dataclasses.replace(c, axes=frozenset({"data"})) for c in result]

    class Wide:
        @pp.hookimpl
        def polyparallel_capabilities(self):
            return pp.Capabilities("wide", axes={"data", "tensor", "pipeline"})

    manager.register(Wide(), name="wide")
    manager.register(Narrow(), name="narrow")
    assert manager.runtimes()["wide"].axes == {"data"} and manager.runtimes()["wide"].plugin == "wide"


# -- plugins are validated: a misspelled hook is an error ------------------------------------------------------------


class Misspelled:
    @pp.hookimpl
    def polyparallel_shard_dat(self, data):
        return "never called"


def test_a_misspelled_hook_is_refused_naming_the_plugin_and_the_hook(manager):
    with pytest.raises(pluggy.PluginValidationError, match=(
            r"plugin 'typo' implements polyparallel_shard_dat \(did you mean polyparallel_shard_data\?\), which is "
            r"not a polyparallel hook\. Rename it to one of the hooks in polyparallel/hookspecs\.py")):
        manager.register(Misspelled(), name="typo")
    assert "typo" not in names(manager) and not manager._pm.has_plugin("typo")  # nothing half-registered


def test_a_hook_of_another_project_may_be_marked_optional(manager):
    class Optional:
        @pp.hookimpl(optionalhook=True)
        def polyparallel_future_hook(self):
            return None

    assert manager.register(Optional(), name="optional") == "optional"


def test_an_entry_point_with_a_misspelled_hook_is_a_broken_plugin(fake_install):
    fake_install.add("typo", Misspelled(), dist="polyparallel-typo", version="0.2")
    fake_install.add("alpha", Owner("alpha"))
    pm = pp.PluginManager()
    with pytest.warns(RuntimeWarning, match=r"skipping plugin 'typo' .*PluginValidationError: plugin 'typo' "
                                            r"implements polyparallel_shard_dat"):
        assert names(pm) == ["polyparallel.core", "alpha"]
    (broken,) = pm.broken()
    assert (broken.name, broken.dist, broken.version) == ("typo", "polyparallel-typo", "0.2")
    assert "polyparallel_shard_dat" in broken.error


# -- a broken installed plugin: its error reaches the user where they use it -----------------------------------------


@pytest.fixture
def broken_lightning(fake_install):
    """polyparallel's own lightning entry point, installed, whose import fails."""
    fake_install.add("lightning", ImportError("cannot import name 'LightningModule' from 'lightning'"),
                     dist="polyparallel", version="0.1.0")
    fake_install.add("alpha", Owner("alpha"))
    pm = pp.PluginManager()
    with pytest.warns(RuntimeWarning, match="skipping plugin 'lightning'"):
        pm.load()
    return pm


def test_broken_plugins_are_remembered(broken_lightning):
    (broken,) = broken_lightning.broken()
    assert (broken.name, broken.value, broken.dist, broken.version) == (
        "lightning", "fake_lightning_module", "polyparallel", "0.1.0")
    assert broken.error == "ImportError: cannot import name 'LightningModule' from 'lightning'"


def test_adapt_names_the_broken_plugin_instead_of_an_install_hint(broken_lightning):
    with pytest.raises(pp.NoPluginError) as info:
        strategy(broken_lightning).adapt("lightning")
    message = str(info.value)
    assert message == (
        "No adapter named 'lightning' is registered. Registered adapters: none. The installed plugin 'lightning' "
        "(fake_lightning_module from polyparallel 0.1.0) failed to load: ImportError: cannot import name "
        "'LightningModule' from 'lightning'; fix that error (the plugin is installed, so installing it again will "
        "not help).")
    assert "pip install" not in message


def test_other_messages_mention_broken_plugins_that_may_be_the_one_wanted(broken_lightning):
    with pytest.raises(pp.NoPluginError, match=r"Install its extra: pip install 'polyparallel\[keras\]'\. Plugins that "
                                               r"failed to load \(one may be the one you need\): the installed plugin "
                                               r"'lightning' .* ImportError"):
        strategy(broken_lightning).adapt("keras")
    with pytest.raises(pp.NoPluginError, match=r"Plugins that failed to load .*'lightning'"):
        strategy(broken_lightning).shard_data(object())


def test_dispatch_and_runtime_choice_name_a_broken_runtime_plugin(fake_install):
    fake_install.add("torch", ImportError("libtorch_cpu.so: cannot open shared object file"), dist="polyparallel",
                     version="0.1.0")
    pm = pp.PluginManager()
    with pytest.warns(RuntimeWarning):
        pm.load()
    tensor_type = type("Tensor", (), {"__module__": "torch"})
    with pytest.raises(pp.NoPluginError) as info:
        strategy(pm).shard_data(tensor_type())
    assert "The installed plugin 'torch' (fake_torch_module from polyparallel 0.1.0) failed to load: ImportError: " \
           "libtorch_cpu.so" in str(info.value) and "pip install" not in str(info.value)
    with pytest.raises(pp.NoPluginError, match=r"Strategy\(runtime='torch'\) names the runtime 'torch', but: The "
                                               r"installed plugin 'torch' .* failed to load: ImportError"):
        pp.Strategy(runtime="torch", plugin_manager=pm).session()
    with pytest.raises(pp.NoPluginError, match=r"launch\(\) needs a runtime, but no runtime is installed\. The installed "
                                               r"plugin 'torch' .*failed to load"):
        pp.launch(print, pp.Strategy(plugin_manager=pm), 2)


def test_registering_a_fixed_plugin_forgets_its_failure(broken_lightning):
    broken_lightning.register(Adapters("lightning"), name="lightning")
    assert broken_lightning.broken() == []
    assert strategy(broken_lightning).adapt("lightning") == ("built", {})
