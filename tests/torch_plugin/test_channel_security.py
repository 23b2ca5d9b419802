"""The hang reports' side channel keeps to the job: every listener a launched job opens is on
loopback, and what others write to the channel's store (a forged "has exited", a request counter
that is not a number, a request signed with another key) is ignored and reported, never believed
and never fatal."""

import ipaddress
import json
import os
import socket
import struct
import subprocess
import time

import pytest

import polyparallel as pp
from polyparallel import _trace

PREFIX = "polyparallel/trace/0//"  # PrefixStore joins with "/"


# -- the machine's sockets ----------------------------------------------------------------------------------------


def _non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (IPv4 first), or ``None``."""
    found: list[str] = []
    try:
        found += subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        found += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)]
    except OSError:
        pass
    usable = []
    for text in found:
        try:
            ip = ipaddress.ip_address(text.split("%")[0])
        except ValueError:
            continue
        if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
            usable.append(ip)
    usable.sort(key=lambda ip: ip.version)
    return str(usable[0]) if usable else None


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    return inodes


def _listening_ports(pids: list[int]) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket the processes ``pids`` listen on (from /proc)."""
    inodes = set().union(*(_socket_inodes(pid) for pid in pids))
    found = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        with open(f"/proc/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                if v6:
                    raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, 16, 4))
                    text = socket.inet_ntop(socket.AF_INET6, raw)
                else:
                    text = socket.inet_ntoa(struct.pack("<I", int(address, 16)))
                found.append((text, int(port, 16)))
    return found


def _served(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=3):
            return True
    except OSError:
        return False


def _probe_listeners(strategy, address):
    """Each rank: every port it and the launcher listen on, and whether ``address`` reaches it."""
    strategy.reduce_metrics({"x": 1.0})  # the groups and the side channel exist
    ports = _listening_ports([os.getpid(), os.getppid()])
    reached = {f"{host}:{port}": _served(address, port) for host, port in ports}
    strategy.reduce_metrics({"x": 1.0})  # every rank's listeners stay up while the others probe
    return {"reached": reached, "store": os.environ.get("POLYPARALLEL_TRACE_STORE"),
            "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_no_listener_of_a_launched_job_serves_a_non_loopback_address():
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no address but loopback (hostname -I): nothing to connect from")
    control = socket.create_server(("", 0), family=socket.AF_INET6 if ":" in address else socket.AF_INET)
    with control:  # a socket on every interface is reached through that address: the probe can tell
        assert _served(address, control.getsockname()[1])
    strategy = pp.Strategy(data=2, timeout=30)
    results = pp.launch(_probe_listeners, strategy, 2, args=(strategy, address), timeout=90)
    for rank, result in enumerate(results):
        listening = result["reached"]
        # the launcher's store (the side channel) and rank 0's rendezvous store are among them
        assert result["store"].split(":")[-1] in {p.rsplit(":", 1)[1] for p in listening}, result
        if rank == 0:
            assert result["master"].split(":")[-1] in {p.rsplit(":", 1)[1] for p in listening}, result
        assert all(host.rsplit(":", 1)[0] in ("127.0.0.1", "::1") for host in listening), result
        assert not any(listening.values()), f"rank {rank}: served on {address}: {result}"


# -- forged values --------------------------------------------------------------------------------------------------


def _forge_then_hang(strategy):
    import datetime

    import torch.distributed as dist

    strategy.reduce_metrics({"loss": 1.0})  # #1: every rank
    if strategy.rank == 0:
        time.sleep(1.0)  # rank 1 forges first
        strategy.reduce_metrics({"loss": 2.0})  # #2: rank 0 only
        return 0
    # Someone else on the host, with the store's address: says rank 1 has exited, and breaks the
    # request counter (a non-integer where main's channel did store.add).
    host, _, port = os.environ["POLYPARALLEL_TRACE_STORE"].rpartition(":")
    other = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    forged = {"rank": 1, "gen": 10**6, "time": time.time(), "exited": True, "entries": [], "stack": None}
    other.set(PREFIX + "state/1", json.dumps(forged))
    other.set(PREFIX + "request", "not a number")
    time.sleep(strategy.timeout + 8)  # rank 1 is alive, outside any collective
    return 1


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_forged_store_values_are_not_believed_and_the_channel_survives_them():
    strategy = pp.Strategy(data=2, timeout=6)
    with pytest.raises(pp.LaunchError) as info:
        pp.launch(_forge_then_hang, strategy, 2, args=(strategy,), timeout=90)
    text = str(info.value)
    first_line = text.splitlines()[0]
    assert "rank 0 of 2 failed: CollectiveTimeout: reduce_metrics #2" in first_line, text
    assert "has exited" not in first_line, text  # the forged state is not believed
    assert "rank 1 has not entered any collective since reduce_metrics #1" in first_line, text
    assert "rank 1's stack" in text, text  # rank 1's thread survived the non-integer counter and answered
    assert "ignored" in text and "not signed with this job's key" in text, text


def test_a_channel_ignores_garbage_and_foreign_requests_and_keeps_answering(tmp_path):
    import torch.distributed as dist

    from polyparallel_torch.channel_auth import seal, unseal
    from polyparallel_torch.tracing import SideChannel

    key = os.urandom(32)
    store = dist.HashStore()
    recorder = _trace.Recorder()
    with pytest.warns(RuntimeWarning, match="ignored a value in its store"):
        channel = SideChannel(store, 1, recorder, poll_s=0.02, key=key)
        try:
            state = lambda: unseal(key, "state/1", store.get("state/1"))[0]  # noqa: E731
            store.set("request", b"\xff not a number")
            store.set("state/0", json.dumps({"rank": 0, "gen": 5, "exited": True}))
            time.sleep(0.2)
            store.set("request", seal(os.urandom(32), "request", {"gen": 7, "rank": 0}))  # another key
            time.sleep(0.2)
            assert channel._thread.is_alive() and state()["gen"] == 0, "answered nothing forged"
            # a value signed for another key name is not believed either
            store.set("request", seal(key, "state/0", {"gen": 7, "rank": 0}))
            time.sleep(0.2)
            assert state()["gen"] == 0
            store.set("request", seal(key, "request", {"gen": 7, "rank": 0}))  # the job's own request
            deadline = time.monotonic() + 5
            while state()["gen"] != 7 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert state()["gen"] == 7 and state()["exited"] is False
            # collecting: rank 0's forged "exited" state is not an answer
            assert channel.collect([0], wait_s=0.3) == {0: None}
            assert channel.rejected_count >= 4, channel.rejected
            assert "not signed with this job's key" in channel.rejected_note()
        finally:
            channel.close()


@pytest.mark.parametrize("value", [
    {"rank": 1, "gen": "7", "time": 0.0, "exited": False, "entries": [], "stack": None},
    {"rank": 2, "gen": 7, "time": 0.0, "exited": False, "entries": [], "stack": None},
    {"rank": 1, "gen": 7, "time": 0.0, "exited": "no", "entries": [], "stack": None},
    {"rank": 1, "gen": 7, "time": 0.0, "exited": False, "entries": [{"operation": 3}], "stack": None},
    {"rank": 1, "gen": 7, "time": 0.0, "exited": False, "entries": [], "stack": ["x"]},
    [1, 2],
])
def test_signed_states_of_the_wrong_shape_are_refused(value):
    from polyparallel_torch.channel_auth import state_problem

    assert state_problem(value, 1) is not None
    assert state_problem({"rank": 1, "gen": 7, "time": 0.0, "exited": False, "entries": [], "stack": None}, 1) is None
