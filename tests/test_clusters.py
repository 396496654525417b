"""The cluster environment readers (stratagem.clusters), each alone on its variables, and
their precedence: what `stratagem run` and a process Slurm started find without rendezvous
flags."""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Iterator

import pytest

from stratagem.cli import build_parser, cluster_env
from stratagem.clusters import (
    SOURCE_ENV,
    ClusterEnvError,
    adopt_tasks,
    kubeflow,
    resolve_node,
    skypilot,
    slurm,
    torchrun,
)


def _slurm_step(**extra: str) -> dict[str, str]:
    """A task of `srun` on 2 nodes, one task per node (node 1's view)."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
           "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
           "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_STEP_NODELIST": "node[01-02]",
           "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    env.update(extra)
    return env


# -- Slurm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("nodelist, hosts", [
    ("solo", ["solo"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu5,cpu[10-11]", ["gpu5", "cpu10", "cpu11"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("a[1,3],b", ["a1", "a3", "b"]),
])
def test_nodelists_expand_as_slurm_writes_them(nodelist: str, hosts: list[str]) -> None:
    assert slurm.expand_nodelist(nodelist) == hosts
    assert slurm.first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("bad, words", [
    ("n[1-", "unmatched '['"), ("n1]", "unmatched ']'"), ("n[3-1]", "runs backwards"),
    ("n[a-b]", "not a number"), ("", "names no host"), ("n[1-1000000]", "more than 65536"),
])
def test_malformed_nodelists_are_refused_by_name(bad: str, words: str) -> None:
    with pytest.raises(ClusterEnvError, match=words.replace("[", r"\[").replace("]", r"\]")):
        slurm.expand_nodelist(bad)


def test_first_host_does_not_write_out_a_huge_list() -> None:
    assert slurm.first_host("n[000001-999999]") == "n000001"


def test_tasks_per_node_notation() -> None:
    assert slurm.tasks_per_node("2(x3),1", 4, "X") == [2, 2, 2, 1]
    with pytest.raises(ClusterEnvError, match="gives 2 nodes, the step has 3"):
        slurm.tasks_per_node("1(x2)", 3, "X")
    with pytest.raises(ClusterEnvError, match="tasks-per-node notation"):
        slurm.tasks_per_node("2x", 1, "X")


def test_one_launcher_per_node_under_srun() -> None:
    place = slurm.node(_slurm_step())
    assert place is not None
    assert (place.nnodes, place.node_rank, place.master_addr, place.master_port) == (
        2, 1, "node01", slurm.PORT_BASE + 4242)
    assert slurm.derived_port({"SLURM_JOB_ID": "123456"}) == slurm.PORT_BASE + 3456


def test_several_launchers_on_a_node_are_refused_with_the_fix() -> None:
    env = _slurm_step(SLURM_STEP_NUM_TASKS="4", SLURM_NTASKS="4")
    with pytest.raises(ClusterEnvError, match="srun --ntasks-per-node=1 stratagem run"):
        slurm.node(env)


def test_a_batch_scripts_own_shell_is_not_a_step() -> None:
    """sbatch's shell sees the allocation (SLURM_NTASKS=4) but runs once: not a world of 4."""
    env = _slurm_step(SLURM_NTASKS="4")
    del env["SLURM_STEP_ID"]
    assert slurm.node(env) is None and slurm.tasks(env) is None


def test_tasks_of_srun_python_get_torchruns_variables() -> None:
    env = _slurm_step(SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NODEID="1",
                      SLURM_STEP_NUM_TASKS="4", SLURM_NTASKS="4",
                      SLURM_STEP_TASKS_PER_NODE="2(x2)")
    place = adopt_tasks(env)
    assert place is not None
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT", SOURCE_ENV)} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node01",
        "MASTER_PORT": str(slurm.PORT_BASE + 4242), SOURCE_ENV: "Slurm"}


def test_uneven_tasks_per_node_leave_local_world_size_unset() -> None:
    env = _slurm_step(SLURM_PROCID="2", SLURM_LOCALID="0", SLURM_NODEID="1",
                      SLURM_STEP_NUM_TASKS="3", SLURM_NTASKS="3",
                      SLURM_STEP_TASKS_PER_NODE="2,1")
    assert adopt_tasks(env) is not None
    assert env["WORLD_SIZE"] == "3" and "LOCAL_WORLD_SIZE" not in env


def test_one_node_step_meets_on_loopback_and_master_port_wins() -> None:
    env = _slurm_step(SLURM_NODEID="0", SLURM_PROCID="1", SLURM_LOCALID="1",
                      SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1",
                      SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="node07",
                      MASTER_PORT="31337")
    adopt_tasks(env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "31337")
    # The port was given, not derived: a taken port is not blamed on the job id.
    assert SOURCE_ENV not in env


def test_srun_torchrun_keeps_torchruns_variables() -> None:
    env = _slurm_step(RANK="5", WORLD_SIZE="8", MASTER_ADDR="10.0.0.9")
    assert torchrun.launched(env)
    before = dict(env)
    assert adopt_tasks(env) is None and env == before


def test_a_one_task_step_is_a_single_process() -> None:
    env = _slurm_step(SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1", SLURM_PROCID="0")
    assert adopt_tasks(env) is None and "RANK" not in env


@pytest.mark.parametrize("name, value", [("SLURM_PROCID", "x"), ("SLURM_NODEID", "-1"),
                                         ("SLURM_JOB_ID", "12ab")])
def test_malformed_slurm_variables_are_named(name: str, value: str) -> None:
    env = _slurm_step(SLURM_STEP_NUM_TASKS="4", SLURM_NTASKS="4",
                      SLURM_STEP_TASKS_PER_NODE="2(x2)", **{name: value})
    with pytest.raises(ClusterEnvError, match=name):
        adopt_tasks(env)


# -- Kubeflow and SkyPilot -------------------------------------------------------------------


def _pet(**extra: str) -> dict[str, str]:
    env = {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "2",
           "PET_MASTER_ADDR": "trainjob-node-0-0.trainjob", "PET_MASTER_PORT": "29400"}
    env.update(extra)
    return env


def test_kubeflow_pet_variables() -> None:
    place = kubeflow.node(_pet())
    assert place is not None
    assert (place.nnodes, place.node_rank, place.nproc_per_node, place.master_addr,
            place.master_port) == (3, 2, 4, "trainjob-node-0-0.trainjob", 29400)
    assert kubeflow.node({"HOME": "/root"}) is None
    auto = kubeflow.node(_pet(PET_NPROC_PER_NODE="auto"))
    assert auto is not None and auto.nproc_per_node is None
    with pytest.raises(ClusterEnvError, match="MIN:MAX"):
        kubeflow.node(_pet(PET_NNODES="1:4"))
    with pytest.raises(ClusterEnvError, match="PET_NODE_RANK=3 is not below PET_NNODES=3"):
        kubeflow.node(_pet(PET_NODE_RANK="3"))


def test_skypilot_variables() -> None:
    env = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
           "SKYPILOT_NODE_IPS": "10.1.0.4\n10.1.0.5\n", "SKYPILOT_NUM_GPUS_PER_NODE": "8"}
    place = skypilot.node(env)
    assert place is not None
    assert (place.nnodes, place.node_rank, place.master_addr, place.nproc_per_node) == (
        2, 1, "10.1.0.4", 8)
    cpu = skypilot.node({**env, "SKYPILOT_NUM_GPUS_PER_NODE": "0"})
    assert cpu is not None and cpu.nproc_per_node is None  # CPU nodes: --nproc decides
    with pytest.raises(ClusterEnvError, match="lists 2 addresses, SKYPILOT_NUM_NODES=3"):
        skypilot.node({**env, "SKYPILOT_NUM_NODES": "3"})


# -- precedence ------------------------------------------------------------------------------


def test_flags_beat_torchrun_beats_kubeflow_beats_slurm() -> None:
    env = {**_slurm_step(), **_pet(), "MASTER_ADDR": "10.9.9.9"}
    place = resolve_node(env, node_rank=0)
    assert place.node_rank == 0 and place.sources["node_rank"] == "flag"
    assert place.master_addr == "10.9.9.9"  # MASTER_ADDR above PET_MASTER_ADDR
    assert place.sources["master_addr"] == "MASTER_ADDR / MASTER_PORT"
    assert place.nnodes == 3 and place.sources["nnodes"] == "Kubeflow (PET_*)"  # not Slurm's 2
    assert place.master_port == 29400
    only_slurm = resolve_node(_slurm_step())
    assert (only_slurm.nnodes, only_slurm.sources["nnodes"]) == (2, "Slurm")


def test_two_sources_of_one_level_that_disagree_are_an_error_naming_both() -> None:
    env = {**_pet(), "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1",
           "SKYPILOT_NODE_IPS": "a\nb"}
    with pytest.raises(ClusterEnvError) as info:
        resolve_node(env)
    text = str(info.value)
    assert "Kubeflow (PET_*) says 3" in text and "SkyPilot (SKYPILOT_*) says 2" in text
    assert "--nnodes" in text
    # The same values from both: no conflict.
    agree = {**_pet(PET_NNODES="2", PET_NODE_RANK="1", PET_MASTER_ADDR="a"),
             "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "a\nb",
             "SKYPILOT_NUM_GPUS_PER_NODE": "4"}
    assert resolve_node(agree).nnodes == 2
    # A flag settles it.
    assert resolve_node(env, nnodes="3", node_rank=1, master_addr="a",
                        nproc_per_node=4).nnodes == "3"


# -- stratagem run ---------------------------------------------------------------------------


def _run_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


def test_stratagem_run_takes_the_rendezvous_from_a_trainjob_pod(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = _run_args("train.py")
    assert cluster_env(args, _pet()) is None
    assert (args.nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        4, "3", 2, "trainjob-node-0-0.trainjob", 29400)
    assert "from the environment: nproc=4 (Kubeflow (PET_*))" in capsys.readouterr().err


def test_stratagem_run_under_srun_and_a_conflicting_flag() -> None:
    args = _run_args("--nproc", "2", "train.py")
    assert cluster_env(args, _slurm_step()) is None
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        "2", 1, "node01", slurm.PORT_BASE + 4242)
    # A flag that contradicts the environment wins (flags rank highest).
    args = _run_args("--nproc", "2", "--nnodes", "3", "--master-port", "29999", "train.py")
    assert cluster_env(args, _slurm_step()) is None
    assert (args.nnodes, args.node_rank, args.master_port) == ("3", 1, 29999)


def test_stratagem_run_on_one_node_stays_on_loopback() -> None:
    """One node: nothing from the environment but the worker count; the job listens on
    127.0.0.1 whatever MASTER_ADDR or PET_MASTER_ADDR say."""
    args = _run_args("train.py")
    env = _pet(PET_NNODES="1", PET_NODE_RANK="0", MASTER_ADDR="10.0.0.1")
    assert cluster_env(args, env) is None
    assert (args.nproc, args.nnodes, args.master_addr) == (4, None, None)


def test_stratagem_run_without_nproc_anywhere_says_so() -> None:
    problem = cluster_env(_run_args("train.py"), {})
    assert problem is not None and "--nproc is required" in problem
    problem = cluster_env(_run_args("--nproc", "2", "train.py"),
                          _slurm_step(SLURM_STEP_NUM_TASKS="4", SLURM_NTASKS="4"))
    assert problem is not None and "--ntasks-per-node=1" in problem


@pytest.fixture
def restored_environ() -> Iterator[None]:
    """os.environ as it was after the test, whatever the code under test wrote into it
    (adopt_tasks writes torchrun's variables, as torchrun would have)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_one_device_under_srun_warns_like_under_torchrun(monkeypatch: pytest.MonkeyPatch,
                                                         restored_environ: None) -> None:
    import stratagem as sg

    for k, v in _slurm_step(SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2", SLURM_NODEID="0",
                            SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_STEP_NUM_NODES="1",
                            SLURM_NNODES="1", SLURM_STEP_TASKS_PER_NODE="2").items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", SOURCE_ENV):
        monkeypatch.delenv(k, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sg.OneDevice()
    assert any("WORLD_SIZE=2" in str(w.message) for w in caught)


def test_fault_tolerance_under_srun_python_names_the_launcher_to_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchft")
    from stratagem.ft import launch as ft_launch

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    for k in ("STRATAGEM_FT_LIGHTHOUSE", "STRATAGEM_FT_SLOT", "STRATAGEM_FT_SLOTS"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="srun --ntasks-per-node=1 stratagem run "
                                           "--fault-tolerant"):
        ft_launch.comm_from_env(timeout=5.0, device=None, min_replicas=1)
