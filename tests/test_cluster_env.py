"""This host's place in a job on a cluster (``ds_dynatrain.elastic.cluster_env``): read from the
variables ``srun`` sets and from what a Kubernetes Indexed Job or StatefulSet gives a pod, the flags
winning over them, and partial or inconsistent variables refused with the reason. Oracles: the
node count, rank and store address written by hand for each environment."""

from __future__ import annotations

import os

import pytest

from ds_dynatrain.elastic.cluster_env import SLURM_PORT_BASE, NodePlace, node_place
from ds_dynatrain.errors import ConfigError

# what srun --nodes=4 --ntasks-per-node=1 sets in the task on the third node (node id 2)
SRUN = {
    "SLURM_JOB_ID": "123456",
    "SLURM_NODEID": "2",
    "SLURM_PROCID": "2",
    "SLURM_NNODES": "4",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NTASKS": "4",
    "SLURM_JOB_NODELIST": "gpu[07-08,11],gpu20",
    "SLURM_STEP_NODELIST": "gpu[07-08,11],gpu20",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_NUM_TASKS": "4",
}


def test_srun_gives_node_rank_count_and_store_host():
    place = node_place(None, None, None, environ=SRUN, hostname="gpu11")
    assert place == NodePlace(4, 2, "gpu07", SLURM_PORT_BASE + 3456, "SLURM")
    # --store :PORT names the port only; the host still comes from the node list
    assert node_place(None, None, ":29400", environ=SRUN) == NodePlace(4, 2, "gpu07", 29400, "SLURM")
    # SLURM_PROCID alone (one task per node) is the node rank too
    env = {k: v for k, v in SRUN.items() if k != "SLURM_NODEID"}
    assert node_place(None, None, None, environ=env).node_rank == 2


def test_a_step_on_part_of_the_allocation_reads_the_step_variables():
    env = dict(SRUN, SLURM_STEP_NODELIST="gpu[08,11]", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2")
    env.update(SLURM_NODEID="1", SLURM_PROCID="1")
    assert node_place(None, None, None, environ=env) == NodePlace(2, 1, "gpu08", SLURM_PORT_BASE + 3456, "SLURM")


def test_a_batch_script_on_one_node_launches_itself():
    """sbatch --nodes=1 --ntasks=4: the batch script's variables, no step; SLURM_NTASKS counts the
    workers `dynatrain launch --nproc 4` starts, not agents."""
    env = {
        "SLURM_JOB_ID": "99",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_NODELIST": "gpu07",
    }
    assert node_place(None, None, None, environ=env) == NodePlace(1, 0, "gpu07", SLURM_PORT_BASE + 99, "SLURM")


def test_flags_win_over_the_environment():
    assert node_place(None, 0, "10.0.0.5:5000", environ=SRUN) == NodePlace(4, 0, "10.0.0.5", 5000, "SLURM")
    assert node_place(1, 0, "127.0.0.1:0", environ=SRUN) == NodePlace(1, 0, "127.0.0.1", 0, "flags")
    # every flag given: SLURM's variables are not read at all (even broken ones)
    assert node_place(2, 1, "h:1", environ={"SLURM_NODEID": "x"}) == NodePlace(2, 1, "h", 1, "flags")


def test_without_a_scheduler_the_defaults_are_one_host():
    assert node_place(None, None, None, environ={}) == NodePlace(1, 0, None, 0, "flags")
    assert node_place(2, 1, "10.0.0.1:29500", environ={}) == NodePlace(2, 1, "10.0.0.1", 29500, "flags")
    with pytest.raises(ConfigError, match="--nnodes 2 needs --node-rank"):
        node_place(2, None, "10.0.0.1:29500", environ={})
    with pytest.raises(ConfigError, match=r"node rank 2 \(flags\) with 2 nodes"):
        node_place(2, 2, "10.0.0.1:29500", environ={})


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"SLURM_JOB_NODELIST": None, "SLURM_STEP_NODELIST": None},
            "partial SLURM variables: .* without SLURM_JOB_NODELIST",
        ),
        (
            {"SLURM_NNODES": None, "SLURM_JOB_NUM_NODES": None, "SLURM_STEP_NUM_NODES": None},
            "partial SLURM variables: .* without SLURM_NNODES",
        ),
        ({"SLURM_STEP_NODELIST": "gpu[07-08"}, "SLURM_STEP_NODELIST='gpu\\[07-08' is not a SLURM hostlist"),
        ({"SLURM_STEP_NODELIST": "gpu[07-09]"}, "names 3 hosts, but the node count is 4"),
        ({"SLURM_STEP_NUM_NODES": None, "SLURM_JOB_NUM_NODES": "5"}, "disagree on the node count"),
        ({"SLURM_STEP_NUM_TASKS": "8"}, "8 tasks on 4 nodes.*--ntasks-per-node=1"),
        ({"SLURM_NODEID": "4"}, "SLURM node rank 4 with 4 nodes"),
        ({"SLURM_NODEID": "two"}, "SLURM_NODEID='two' is not an integer"),
    ],
)
def test_partial_or_inconsistent_slurm_variables_are_refused(change, message):
    env = dict(SRUN)
    for k, v in change.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    with pytest.raises(ConfigError, match=message):
        node_place(None, None, None, environ=env)


def test_kubernetes_indexed_job_and_statefulset():
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    store = "train-0.train:29500"
    # an Indexed Job: the completion index
    got = node_place(3, None, store, environ=dict(pod, JOB_COMPLETION_INDEX="2"), hostname="train-2-x7k2p")
    assert got == NodePlace(3, 2, "train-0.train", 29500, "Kubernetes")
    # a StatefulSet (or an Indexed Job with a subdomain): the ordinal of the pod's host name
    assert node_place(3, None, store, environ=pod, hostname="train-1") == NodePlace(
        3, 1, "train-0.train", 29500, "Kubernetes"
    )
    # a pod that is not of the store's set, or a host outside Kubernetes, is not guessed at
    with pytest.raises(ConfigError, match="--nnodes 3 needs --node-rank"):
        node_place(3, None, store, environ=pod, hostname="other-1")
    with pytest.raises(ConfigError, match="--nnodes 3 needs --node-rank"):
        node_place(3, None, store, environ={}, hostname="train-1")
    with pytest.raises(ConfigError, match=r"node rank 3 \(Kubernetes\) with 3 nodes"):
        node_place(3, None, store, environ=dict(pod, JOB_COMPLETION_INDEX="3"), hostname="x")
    # --node-rank wins
    assert node_place(3, 0, store, environ=dict(pod, JOB_COMPLETION_INDEX="2")).node_rank == 0


def test_a_malformed_store_is_refused():
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        node_place(None, None, "host:port", environ={})
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        node_place(None, None, "host:70000", environ={})


def test_launch_refuses_a_bad_place_or_slots_with_one_line_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    """`dynatrain launch` (its ``main``, in this process) under partial SLURM variables, with
    --slots below --nproc, and with a resize_schedule past the host's slots: status 2, one line
    naming the reason on stderr, no worker started."""
    import json

    from ds_dynatrain.cli.main import main

    cfg = tmp_path / "cfg.json"
    cfg.write_text(
        json.dumps(
            {
                "train_batch_size": 12,
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {"stage": 2},
                "dynatrain": {"resize_schedule": [{"step": 3, "world_size": 3}, {"step": 6, "world_size": 2}]},
            }
        )
    )
    marker = tmp_path / "started"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    cases = [
        (
            ["--nproc", "2", "--slots", "3"],
            {"SLURM_NODEID": "1", "SLURM_JOB_ID": "7"},
            "dynatrain launch: partial SLURM variables: a node rank (SLURM_NODEID=1) without SLURM_NNODES and "
            "SLURM_JOB_NODELIST; run under srun, or give --nnodes, --node-rank and --store",
        ),
        (
            ["--nproc", "2", "--slots", "1"],
            {},
            "dynatrain launch: --slots 1 is less than --nproc 2: a host starts at most its slots",
        ),
        (
            ["--nproc", "2"],
            {},
            "dynatrain launch: dynatrain.resize_schedule grows to 3 ranks at step 3, but the job has 2 slots "
            "(1 host x 2); give --slots, more hosts, or --allow-oversubscribe",
        ),
        (["--nproc", "2", "--slots", "0"], {}, "dynatrain launch: --slots must be >= 1"),
    ]
    for args, env, line in cases:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            rc = main(["launch", *args, "--config", str(cfg), str(script)])
        err = capsys.readouterr().err
        assert rc == 2 and [x for x in err.splitlines() if x.startswith("dynatrain")] == [line], (args, err)
    assert not marker.exists()
