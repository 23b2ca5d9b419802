"""polyparallel._slurm: SLURM's node lists and task variables in torchrun's names (pure functions;
the real SLURM runs in the SLURM lane, tests/slurm_lane via tools/test-slurm.sh)."""

import pytest

import polyparallel as pp
from polyparallel._slurm import adopt, expand_nodelist, launch_options, master_port, slurm_task


def step(**extra):
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
           "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4312345"}
    env.update(extra)
    return env


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
    ("gpu[01-02],login", ["gpu01", "gpu02", "login"]),
    ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
    ("a[009-011]", ["a009", "a010", "a011"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[1-3", "node1-3]", "node[a-b]"])
def test_a_malformed_nodelist_is_refused(bad):
    with pytest.raises(pp.TopologyError, match="malformed SLURM node list"):
        expand_nodelist(bad)


def test_a_step_task_in_torchruns_names():
    env = step()
    task = adopt(env)
    assert task is not None and env["RANK"] == "1" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "0"
    assert env["MASTER_ADDR"] == "gpu07" and env["MASTER_PORT"] == str(15000 + 2345)
    assert adopt(env) == task  # twice: the same


def test_master_port_set_wins_and_the_batch_script_is_no_task():
    assert master_port({"MASTER_PORT": "29500", "SLURM_JOB_ID": "77"}) == 29500
    assert slurm_task(step(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")).master_addr == "10.0.0.1"
    batch = step()
    del batch["SLURM_STEP_ID"]
    assert slurm_task(batch) is None and adopt(batch) is None and "RANK" not in batch


def test_a_launcher_inside_the_task_keeps_its_ranks():
    env = step(SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_STEP_NUM_NODES="1",
               SLURM_STEP_TASKS_PER_NODE="1", RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    assert adopt(env) is None and env["RANK"] == "1"


def test_contradicting_ranks_are_refused():
    with pytest.raises(pp.TopologyError, match="two launchers disagree on its rank"):
        adopt(step(RANK="0", WORLD_SIZE="2"))
    with pytest.raises(pp.TopologyError, match="each task made a world of its own"):
        adopt(step(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2"))
    with pytest.raises(pp.TopologyError, match="contradict each other"):
        adopt(step(SLURM_PROCID="4"))
    with pytest.raises(pp.TopologyError, match="not a non-negative int"):
        adopt(step(SLURM_PROCID="x"))


def test_launch_options_under_srun_one_per_node():
    env = step(SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_NODEID="1",
               SLURM_STEP_TASKS_PER_NODE="1(x2)")
    got = launch_options({"nnodes": "1", "node_rank": 0, "rdzv_endpoint": None}, env)
    assert got == {"nnodes": "2", "node_rank": 1, "rdzv_endpoint": "gpu07:17345"}
    kept = launch_options({"nnodes": "1", "node_rank": 0, "rdzv_endpoint": "h:1"}, env,
                          explicit=frozenset({"rdzv_endpoint"}))
    assert kept["rdzv_endpoint"] == "h:1"
    with pytest.raises(pp.TopologyError, match="one launcher per node"):
        launch_options({"nnodes": "1", "node_rank": 0, "rdzv_endpoint": None}, step())
    assert launch_options({"a": 1}, {}) == {"a": 1}


def test_a_strategy_that_does_not_fit_the_tasks_names_slurm(monkeypatch):
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    for name in names:  # recorded by monkeypatch, so what adopt() sets is removed afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in step(SLURM_STEP_NODELIST="localhost").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(pp.TopologyError, match="SLURM_NTASKS=4 tasks were started"):
        pp.Strategy(data=3).session()
