"""Ranks and the rendezvous of a process started by SLURM (``srun``), in torchrun's names.

Inside a job step (``srun``: ``SLURM_STEP_ID`` is set; the batch script itself is no task), every
task is a rank: ``RANK`` = ``SLURM_PROCID``, ``WORLD_SIZE`` = ``SLURM_NTASKS``, ``LOCAL_RANK`` =
``SLURM_LOCALID``, ``GROUP_RANK`` = ``SLURM_NODEID``, ``LOCAL_WORLD_SIZE`` = this node's entry of
``SLURM_STEP_TASKS_PER_NODE``; ``MASTER_ADDR`` = the first host of the step's node list (expanded
by :func:`expand_nodelist`), ``MASTER_PORT`` = 15000 + the last 4 digits of ``SLURM_JOB_ID`` (as
Lightning's ``SLURMEnvironment``), unless set. :func:`adopt` writes them into ``os.environ``, so
that the session, the torch runtime's process groups, Lightning's cluster environment and the
Ignite adapter all read the same ranks. A launcher inside each task (``polyparallel launch``,
torchrun, ``pp.launch``: ``LOCAL_WORLD_SIZE`` set) keeps its own ranks when its world is
``SLURM_NTASKS`` x its local world; any other disagreement is refused before any collective.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from ._errors import TopologyError

__all__ = ["SlurmTask", "adopt", "expand_nodelist", "in_slurm_step", "launch_options", "slurm_task"]

_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list: ``"node[1-3,5],gpu[01-02]"`` -> node1 node2 node3
    node5 gpu01 gpu02 (zero padding kept; several bracket groups in one name expand in order)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise TopologyError(f"malformed SLURM node list {nodelist!r}: ']' without '['.")
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise TopologyError(f"malformed SLURM node list {nodelist!r}: '[' without ']'.")
    items.append(nodelist[start:])
    hosts: list[str] = []
    for item in (i.strip() for i in items):
        if item:
            hosts.extend(_expand_one(item, nodelist))
    return hosts


def _expand_one(name: str, whole: str) -> list[str]:
    match = _BRACKET.search(name)
    if match is None:
        if "[" in name or "]" in name:
            raise TopologyError(f"malformed SLURM node list {whole!r} at {name!r}.")
        return [name]
    head, tail = name[:match.start()], name[match.end():]
    out = []
    for part in match.group(1).split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise TopologyError(f"malformed SLURM node list {whole!r}: range {part!r} is not N or N-M.")
        width = len(lo)
        for n in range(int(lo), int(hi if sep else lo) + 1):
            out.extend(_expand_one(f"{head}{n:0{width}d}{tail}", whole))
    return out


def _first_host(nodelist: str) -> str:
    try:
        return expand_nodelist(nodelist)[0]
    except (TopologyError, IndexError):
        if shutil.which("scontrol"):  # SLURM's own expansion, for a form the parser does not know
            done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                  timeout=30)
            if done.returncode == 0 and done.stdout.split():
                return done.stdout.split()[0]
        raise


def _tasks_per_node(spec: str) -> list[int]:
    """``"2(x3),1"`` -> [2, 2, 2, 1] (SLURM_STEP_TASKS_PER_NODE)."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise TopologyError(f"SLURM_STEP_TASKS_PER_NODE={spec!r} is not of the form N or N(xK),M.")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


@dataclass(frozen=True)
class SlurmTask:
    """Where a SLURM task sits: its rank in the step, the node, and the rendezvous."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int

    def environment(self) -> dict[str, str]:
        """The task's place in torchrun's names."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def in_slurm_step(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a task of a SLURM job step (started by ``srun``), not the batch
    script or an ``salloc`` shell (which have no ``SLURM_STEP_ID``)."""
    env = os.environ if environ is None else environ
    return bool(env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))) and "SLURM_PROCID" in env and "SLURM_NTASKS" in env


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "")
    if not raw.strip().isdigit():
        raise TopologyError(f"SLURM set {name}={raw!r}, which is not a non-negative int: this task's rank cannot be "
                            "read from SLURM.")
    return int(raw)


def master_port(environ: Mapping[str, str]) -> int:
    """``MASTER_PORT`` when set, else 15000 + the last 4 digits of ``SLURM_JOB_ID`` (Lightning's
    ``SLURMEnvironment`` rule: every task of the job derives the same port), else 12910."""
    if environ.get("MASTER_PORT"):
        return int(environ["MASTER_PORT"])
    digits = "".join(ch for ch in environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID", "")) if ch.isdigit())
    return 15000 + int(digits[-4:]) if digits else 12910


def slurm_task(environ: Mapping[str, str] | None = None) -> SlurmTask | None:
    """This task's place from SLURM's variables, or ``None`` outside a job step."""
    env = os.environ if environ is None else environ
    if not in_slurm_step(env):
        return None
    rank, world, local, node = (_int(env, n) for n in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID"))
    nodes = _int(env, "SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in env else _int(env, "SLURM_NNODES") \
        if "SLURM_NNODES" in env else 1
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    per_node = _tasks_per_node(spec) if spec else [world]
    if not 0 <= rank < world or not 0 <= node < nodes or node >= len(per_node) or not 0 <= local < per_node[node]:
        raise TopologyError(
            f"SLURM's variables contradict each other: SLURM_PROCID={rank}, SLURM_NTASKS={world}, SLURM_NODEID={node} "
            f"of {nodes} nodes, SLURM_LOCALID={local} of {per_node[node] if node < len(per_node) else '?'} tasks on "
            "this node. Start the processes with srun, without setting these variables yourself.")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    addr = env.get("MASTER_ADDR") or (_first_host(nodelist) if nodelist else "127.0.0.1")
    return SlurmTask(rank, world, local, per_node[node], node, nodes, addr, master_port(env))


def adopt(environ: MutableMapping[str, str] | None = None) -> SlurmTask | None:
    """Inside a SLURM job step, set torchrun's variables from SLURM's (module docstring) and
    return the task; ``None`` when not under SLURM or a launcher inside the task set the ranks.
    Refuses (:class:`TopologyError`) ranks set by hand that contradict SLURM's."""
    env = os.environ if environ is None else environ
    task = slurm_task(env)
    if task is None:
        return None
    given = {name: env[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if env.get(name)}
    mine = task.environment()
    if all(mine[name] == value for name, value in given.items()):
        for name, value in mine.items():
            env.setdefault(name, value)
        return task
    if env.get("LOCAL_WORLD_SIZE", "").isdigit() and "RANK" in given and "WORLD_SIZE" in given:
        # A launcher inside the task (polyparallel launch, torchrun, pp.launch) started local processes.
        if int(given["WORLD_SIZE"]) == task.world_size * int(env["LOCAL_WORLD_SIZE"]):
            return None
        raise TopologyError(
            f"A launcher inside each of the {task.world_size} SLURM tasks (SLURM_NTASKS={task.world_size}) started "
            f"{env['LOCAL_WORLD_SIZE']} processes in a world of WORLD_SIZE={given['WORLD_SIZE']}, not "
            f"{task.world_size} x {env['LOCAL_WORLD_SIZE']}: each task made a world of its own. Either one task per "
            "process (`srun -n N python train.py`, no launcher), or one launcher per node (`srun --ntasks-per-node=1 "
            "polyparallel launch --nproc-per-node K train.py`, which reads the nodes from SLURM).")
    shown = ", ".join(f"{k}={v}" for k, v in given.items())
    raise TopologyError(
        f"This process has {shown} (torchrun's variables) but SLURM started it as task SLURM_PROCID={task.rank} of "
        f"SLURM_NTASKS={task.world_size} (SLURM_LOCALID={task.local_rank}): two launchers disagree on its rank. "
        "Unset RANK/WORLD_SIZE/LOCAL_RANK under srun (polyparallel reads SLURM's), or start the processes with "
        "`polyparallel launch`/torchrun only.")


def launch_options(options: dict[str, object], environ: Mapping[str, str] | None = None,
                   explicit: frozenset[str] = frozenset()) -> dict[str, object]:
    """``polyparallel launch``'s options inside a SLURM job step: one launcher per node, so
    ``--nnodes`` = the step's nodes, ``--node-rank`` = ``SLURM_NODEID`` and the rendezvous at the
    first host of the node list, port :func:`master_port` (options given on the command line,
    ``explicit``, win). Outside a step, ``options`` unchanged."""
    env = os.environ if environ is None else environ
    task = slurm_task(env)
    if task is None:
        return options
    if task.world_size != task.num_nodes:
        raise TopologyError(
            f"`polyparallel launch` under srun runs one launcher per node, but this step has SLURM_NTASKS="
            f"{task.world_size} tasks on {task.num_nodes} node(s): run it with `srun --ntasks-per-node=1` (or "
            "`srun -n <nodes>`), or drop the launcher and let every task be a rank (`srun -n N python train.py`).")
    out = dict(options)
    if "nnodes" not in explicit:
        out["nnodes"] = str(task.num_nodes)
    if "node_rank" not in explicit:
        out["node_rank"] = task.node_rank
    if "rdzv_endpoint" not in explicit:
        host = f"[{task.master_addr}]" if ":" in task.master_addr else task.master_addr
        out["rdzv_endpoint"] = f"{host}:{task.master_port}"
    return out
