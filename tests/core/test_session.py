"""``polyparallel/_session.py``: per-process state kept apart from the immutable Strategy."""

from __future__ import annotations

import pytest

import polyparallel as pp
from polyparallel import ProcessInfo, Strategy, Topology
from polyparallel._session import process_info_from_env


def launched(monkeypatch, rank: int, world_size: int, local_rank: int | None = None) -> None:
    """What torchrun puts into each process's environment."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))


class Observer:
    """Sees every session start and finish."""

    def __init__(self, log: list):
        self.log = log

    @pp.hookimpl
    def polyparallel_session_start(self, session):
        self.log.append(("start", session.rank))

    @pp.hookimpl
    def polyparallel_session_finish(self, session):
        self.log.append(("finish", session.rank, session.closed))


# -- rank and world size from the launcher -----------------------------------------------------------------


def test_process_info_defaults_to_one_process():
    assert process_info_from_env() == ProcessInfo(rank=0, world_size=1, local_rank=0)


def test_process_info_from_the_launcher(monkeypatch):
    launched(monkeypatch, rank=5, world_size=8, local_rank=1)
    assert process_info_from_env() == ProcessInfo(5, 8, 1)


def test_empty_variables_count_as_unset(monkeypatch):
    launched(monkeypatch, rank=0, world_size=4)
    monkeypatch.setenv("RANK", "")
    assert process_info_from_env() == ProcessInfo(0, 4, 0)


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "one"}, r"environment variable RANK must be an int\. Received: 'one'\."),
    ({"WORLD_SIZE": "2.0"}, r"environment variable WORLD_SIZE must be an int\. Received: '2\.0'\."),
    ({"RANK": "4", "WORLD_SIZE": "4"}, r"RANK=4 is out of range for WORLD_SIZE=4\."),
    ({"RANK": "-1", "WORLD_SIZE": "4"}, r"RANK=-1 is out of range for WORLD_SIZE=4\."),
])
def test_invalid_launcher_environment(monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(pp.TopologyError, match=message):
        process_info_from_env()


def test_session_from_rank_and_world_size(monkeypatch, manager):
    launched(monkeypatch, rank=6, world_size=8, local_rank=2)
    s = Strategy(tensor=2, pipeline=2, plugin_manager=manager)  # data=-1: inferred as 2
    session = s.session()
    assert (session.rank, session.world_size, session.info.local_rank) == (6, 8, 2)
    assert session.topology == Topology(data=2, tensor=2, pipeline=2)
    assert session.coords == {"pipeline": 1, "data": 1, "tensor": 0}
    assert session.roles == {"loss", "metrics"}
    assert session.group_ranks("tensor") == [6, 7]
    assert session.group_ranks("data") == [4, 6]
    assert session.group_ranks("pipeline") == [2, 6]
    assert session.strategy is s and session.manager is manager and not session.closed
    assert repr(session) == f"<Session rank=6/8 coords={session.coords} of {s!r}>"


def test_a_strategy_that_does_not_fit_the_world(monkeypatch, manager):
    launched(monkeypatch, rank=0, world_size=4)
    with pytest.raises(pp.TopologyError, match=(
            r"Strategy\(pipeline=1, data=3, tensor=1, timeout=60, seed=0\) does not fit the 4 processes launched: "
            r"Topology\(pipeline=1, data=3, tensor=1\) needs 3 ranks but the world size is 4")):
        Strategy(data=3, plugin_manager=manager).session()
    with pytest.raises(pp.TopologyError, match=r"does not fit the 4 processes launched: .* does not divide world size 4"):
        Strategy(tensor=3, plugin_manager=manager).session()
    assert manager.sessions() == []


def test_an_invalid_environment_is_reported_when_the_session_is_made(monkeypatch, manager):
    monkeypatch.setenv("WORLD_SIZE", "many")
    with pytest.raises(pp.TopologyError, match="environment variable WORLD_SIZE must be an int") as info:
        Strategy(plugin_manager=manager).session()
    assert "raised by plugin 'polyparallel.core' in polyparallel_process_info" in info.value.__notes__


def test_a_runtime_plugin_can_tell_the_rank(monkeypatch, manager):
    class XlaLike:
        @pp.hookimpl
        def polyparallel_process_info(self, strategy):
            return ProcessInfo(rank=3, world_size=8)

    launched(monkeypatch, rank=0, world_size=1)  # the core's default (trylast) is not asked
    manager.register(XlaLike(), name="xla-like")
    assert Strategy(plugin_manager=manager).session().info == ProcessInfo(3, 8, 0)


# -- one session per strategy and process ------------------------------------------------------------------


def test_a_session_is_made_once_per_strategy_value(manager):
    log: list = []
    manager.register(Observer(log), name="observer")
    s = Strategy(plugin_manager=manager)
    assert s.session() is s.session() is Strategy(plugin_manager=manager).session()
    other = Strategy(seed=1, plugin_manager=manager).session()
    assert other is not s.session()
    assert log == [("start", 0), ("start", 0)]
    assert manager.sessions() == [s.session(), other]


def test_close_runs_finish_hooks_then_finalizers_last_first(manager):
    log: list = []
    manager.register(Observer(log), name="observer")
    session = Strategy(plugin_manager=manager).session()
    session.add_finalizer(lambda: log.append("destroy process group"))
    session.add_finalizer(lambda: log.append("release mesh"))
    session.close()
    assert log == [("start", 0), ("finish", 0, True), "release mesh", "destroy process group"]
    assert session.closed and manager.sessions() == []
    session.close()  # idempotent
    assert len(log) == 4


def test_a_closed_session_is_replaced_on_next_use(manager):
    s = Strategy(plugin_manager=manager)
    first = s.session()
    first.close()
    second = s.session()
    assert second is not first and not second.closed


def test_a_failing_start_hook_leaves_no_half_started_session(manager):
    # Before: the session was cached before its start hooks ran, so after one failed the next
    # session() returned it as if started (the failing hook never ran again).
    log: list = []
    released: list = []

    class FailsOnce:
        def __init__(self):
            self.failures = 1

        @pp.hookimpl
        def polyparallel_session_start(self, session):
            session.acquire("groups", lambda: "groups", released.append)
            if self.failures:
                self.failures -= 1
                raise OSError("the rendezvous is not up yet")

    manager.register(FailsOnce(), name="fails-once")
    manager.register(Observer(log), name="observer")  # registered last: its start hook runs first
    s = Strategy(plugin_manager=manager)
    with pytest.raises(pp.PluginError, match="fails-once.*polyparallel_session_start.*rendezvous is not up"):
        s.session()
    assert manager.sessions() == [] and released == ["groups"]  # closed: shared resources released
    assert [entry[0] for entry in log] == ["start", "finish"]  # the session is closed: finish hooks run
    session = s.session()  # made again, and its start hooks run again
    assert not session.closed and manager.sessions() == [session]
    assert [entry[0] for entry in log] == ["start", "finish", "start"] and released == ["groups"]


def test_stash_creates_once_and_is_cleared_on_close(manager):
    session = Strategy(plugin_manager=manager).session()
    made = []
    group = session.stash("data_group", lambda: made.append(1) or object())
    assert session.stash("data_group", lambda: made.append(1) or object()) is group
    assert made == [1]
    assert session.peek("data_group") is group
    assert session.peek("mesh") is None and session.peek("mesh", "absent") == "absent"
    session.close()
    assert session.peek("data_group") is None


def test_a_failing_finalizer_does_not_stop_the_others(manager):
    log = []
    session = Strategy(plugin_manager=manager).session()
    session.add_finalizer(lambda: log.append("first added, last called"))
    session.add_finalizer(lambda: 1 / 0)
    session.add_finalizer(lambda: log.append("last added, first called"))
    with pytest.raises(ZeroDivisionError):
        session.close()
    assert log == ["last added, first called", "first added, last called"]
    assert session.closed and manager.sessions() == []


def test_a_failing_finish_hook_names_the_plugin_and_still_tears_down(manager):
    class BrokenFinish:
        @pp.hookimpl
        def polyparallel_session_finish(self, session):
            raise OSError("socket already closed")

    manager.register(BrokenFinish(), name="broken-finish")
    session = Strategy(plugin_manager=manager).session()
    torn_down = []
    session.add_finalizer(lambda: torn_down.append(True))
    with pytest.raises(pp.PluginError, match=r"plugin 'broken-finish' failed in polyparallel_session_finish: "
                                             r"OSError: socket already closed"):
        session.close()
    assert torn_down == [True] and manager.sessions() == []


def test_close_sessions_closes_all_even_if_one_fails(manager):
    first = Strategy(seed=1, plugin_manager=manager).session()
    second = Strategy(seed=2, plugin_manager=manager).session()
    first.add_finalizer(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        manager.close_sessions()
    assert first.closed and second.closed and manager.sessions() == []


# -- resources shared between sessions (process groups) ------------------------------------------------


def test_acquire_shares_one_resource_between_sessions_and_releases_with_the_last(manager):
    made, released = [], []

    def factory():
        made.append(object())
        return made[-1]

    a = Strategy(data=1, plugin_manager=manager).session()
    b = Strategy(data=1, seed=1, plugin_manager=manager).session()
    assert a is not b
    first = a.acquire("groups", factory, released.append)
    assert a.acquire("groups", factory, released.append) is first  # once per session
    assert b.acquire("groups", factory, released.append) is first  # shared, not made again
    assert len(made) == 1
    a.close()
    assert released == []  # b still holds it
    b.close()
    assert released == [first]
    c = Strategy(data=1, plugin_manager=manager).session()
    assert c.acquire("groups", factory, released.append) is not first  # made afresh after release


# -- session scopes: several ranks as threads of one process -----------------------------------------------


def test_each_session_scope_has_its_own_session_closed_when_the_scope_ends(manager):
    import threading

    class ThreadRanks:
        @pp.hookimpl
        def polyparallel_process_info(self):
            scope = pp.current_session_scope()
            return ProcessInfo(scope.key, 2, scope.key) if scope is not None else None

    manager.register(ThreadRanks(), name="thread-ranks")
    strategy = Strategy(data=2, plugin_manager=manager)
    seen: dict[int, tuple] = {}

    def replica(rank: int) -> None:
        with pp.session_scope(rank) as scope:
            session = strategy.session()
            assert strategy.session() is session and manager.sessions() == [session]
            seen[rank] = (session.rank, session.scope is scope, session)
        seen[rank] += (session.closed, manager.sessions())

    threads = [threading.Thread(target=replica, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [seen[r][:2] for r in (0, 1)] == [(0, True), (1, True)]
    assert seen[0][2] is not seen[1][2] and all(seen[r][3] and seen[r][4] == [] for r in (0, 1))
    assert manager.sessions() == []  # the process itself holds no session


def test_session_scopes_do_not_nest():
    with pp.session_scope(0), pytest.raises(RuntimeError, match="scopes do not nest"):
        with pp.session_scope(1):
            pass
