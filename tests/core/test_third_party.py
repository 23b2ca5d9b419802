"""End to end: the example third-party plugin (``examples/third_party_plugin``, distribution
``polyparallel-records``, entry point ``records``) as really installed, in fresh processes.

Nothing here registers the plugin by hand: discovery goes through ``importlib.metadata`` entry
points, exactly as for any plugin a user pip-installs.
"""

from __future__ import annotations

import json

import pytest

#: Loads the default plugin manager the way user code does, then reports what happened.
PROBE = r"""
import json, sys
import polyparallel as pp

pm = pp.get_plugin_manager()
if "--block" in sys.argv:
    pm.set_blocked("records")
loaded = [p.name for p in pm.plugins()]
imported_by_loading = "polyparallel_records" in sys.modules

import polyparallel_records as pr  # importing the module is not registering it

strategy = pp.Strategy(data=-1)
try:
    out = strategy.shard_data(pr.Records(["a", "b", "c", "d", "e"]), shuffle=False, remainder="uneven")
    answer = {"type": f"{type(out).__module__}.{type(out).__qualname__}", "items": list(out.items),
              "indices": list(out.indices)}
except pp.NoPluginError as exc:
    answer = {"error": type(exc).__name__, "message": str(exc)}

report = {"loaded": loaded, "imported_by_loading": imported_by_loading, "answer": answer,
          "adapters": sorted(pm.adapters()), "rank": strategy.rank, "world_size": strategy.world_size}
if "records" in report["adapters"]:
    loop = strategy.adapt("records", batch_size=2)
    report["batches"] = [list(b) for b in loop.batches(pr.Records(list(range(5))))]
    try:
        pp.Strategy(data=1, tensor=2).adapt("records")
    except pp.UnsupportedTopologyError as exc:
        report["refusal"] = str(exc)
if "--block" in sys.argv:
    report["register_blocked"] = pm.register(pr, name="records")
print(json.dumps(report))
"""


def probe(python, *args: str, **env: str) -> dict:
    result = python("-c", PROBE, *args, **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_discovery_through_the_entry_point(python):
    result = python("-m", "polyparallel.cli", "plugins", "--json")
    assert result.returncode == 0, result.stderr
    (records,) = [p for p in json.loads(result.stdout) if p["name"] == "records"]
    assert (records["module"], records["distribution"]) == ("polyparallel_records", "polyparallel-records")
    assert "polyparallel_shard_data" in records["hooks"]
    assert records["adapters"] == ["records"]
    assert [c["axes"] for c in records["capabilities"]] == [["data"]]


def test_dispatch_goes_to_the_plugin(python):
    # Rank 1 of 2 data-parallel ranks: the plugin shards by the session's data coordinate.
    report = probe(python, RANK="1", WORLD_SIZE="2")
    assert "records" in report["loaded"] and report["imported_by_loading"]
    assert (report["rank"], report["world_size"]) == (1, 2)
    assert report["answer"] == {"type": "polyparallel_records.Records", "items": ["b", "d"], "indices": [1, 3]}


def test_the_plugin_adapter_and_its_capabilities(python):
    report = probe(python)
    assert report["answer"]["items"] == ["a", "b", "c", "d", "e"]  # one rank holds everything
    assert [len(b) for b in report["batches"]] == [2, 2, 1]
    assert sorted(x for b in report["batches"] for x in b) == [0, 1, 2, 3, 4]
    assert "'records' (plugin 'records') cannot run tensor=2" in report["refusal"]


def test_disabled_autoload_does_not_load_it(python):
    report = probe(python, POLYPARALLEL_DISABLE_PLUGIN_AUTOLOAD="1")
    assert report["loaded"] == ["polyparallel.core"]
    assert not report["imported_by_loading"]
    assert report["adapters"] == []
    assert report["answer"]["error"] == "NoPluginError"
    assert report["answer"]["message"].startswith(
        "No polyparallel plugin handles shard_data for an object of type polyparallel_records.Records. "
        "Installed plugins: none.")


@pytest.mark.parametrize("names", ["records", "records,", " records "])
def test_disabled_autoload_with_the_plugin_named(python, names):
    report = probe(python, POLYPARALLEL_DISABLE_PLUGIN_AUTOLOAD="1", POLYPARALLEL_PLUGINS=names)
    assert report["loaded"] == ["polyparallel.core", "records"]  # that one, and only that one
    assert report["answer"]["type"] == "polyparallel_records.Records"
    assert report["adapters"] == ["records"]


def test_blocking_the_plugin(python):
    report = probe(python, "--block")
    assert "records" not in report["loaded"]
    assert not report["imported_by_loading"]  # a blocked plugin is not even imported
    assert "records" not in report["adapters"]
    assert report["answer"]["error"] == "NoPluginError"
    assert "polyparallel_records.Records" in report["answer"]["message"]
    assert report["register_blocked"] is None  # registering it by hand is skipped silently
