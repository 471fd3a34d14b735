"""Joiner placement and the launch environment (``ds_dynatrain.elastic``): the pure choice of a
node by free slots, the same choice read from a real ``TCPStore``, and the contract of the
environment variables a worker starts with."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import torch.distributed as tdist

from ds_dynatrain.elastic.keys import MEMBER_NODE_KEY, NODE_ALIVE_KEY, NODE_COUNT, NODE_DONE_KEY, NODE_KEY
from ds_dynatrain.elastic.launch_env import HUGE_PAGES, LaunchContext, enter_generation
from ds_dynatrain.elastic.placement import (
    HEARTBEAT_LOST_S,
    Host,
    check_slots,
    choose_nodes,
    live_nodes,
    place_joiners,
)
from ds_dynatrain.errors import ResizeRefusedError
from tests.conftest import launch


def _hosts(*slots, over=()):
    return {i: Host(k, i in over) for i, k in enumerate(slots)}


def test_joiners_go_to_the_node_with_the_most_free_slots_lowest_id_on_a_tie():
    assert choose_nodes(_hosts(3, 2), {0: 2, 1: 1}, ["j0", "j1"]) == {"j0": 0, "j1": 1}
    assert choose_nodes(_hosts(4, 4), {}, ["j0", "j1", "j2"]) == {"j0": 0, "j1": 1, "j2": 0}
    assert choose_nodes({}, {}, ["j"]) == {"j": 0}  # no agent registry: node 0


def test_no_free_slot_refuses_unless_a_host_allows_oversubscription():
    # 2 slots on each of two hosts, 3 workers: one free slot for two joiners -> refused, nothing placed
    with pytest.raises(
        ResizeRefusedError, match=r"2 new workers need a free slot each, but the job's hosts have 1 free"
    ):
        choose_nodes(_hosts(2, 2), {0: 2, 1: 1}, ["j0", "j1"])
    # node 1 allows oversubscription: the free slot first, then the least loaded host that allows it
    assert choose_nodes(_hosts(2, 2, over={1}), {0: 2, 1: 1}, ["j0", "j1"]) == {"j0": 1, "j1": 1}
    assert choose_nodes(_hosts(1, 2, over={0, 1}), {0: 1, 1: 2}, ["j0", "j1"]) == {"j0": 0, "j1": 1}
    # force: every host, least loaded first (a decision already taken by the job's ranks)
    assert choose_nodes(_hosts(1, 2), {0: 1, 1: 2}, ["j"], force=True) == {"j": 0}


@pytest.fixture()
def store():
    st = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield st


def test_placement_reads_live_agents_and_members_from_the_store(store):
    store.add(NODE_COUNT, 3)
    for node, slots in ((0, 2), (1, 2), (2, 4)):
        store.set(NODE_KEY.format(node), json.dumps({"slots": slots, "oversubscribe": False}))
        store.set(NODE_ALIVE_KEY.format(node), json.dumps({"alive": 1, "time": time.time()}))
    store.set(NODE_DONE_KEY.format(1), "0")  # node 1's agent finished
    store.set(NODE_ALIVE_KEY.format(2), json.dumps({"alive": 3, "time": time.time() - HEARTBEAT_LOST_S - 5}))
    assert live_nodes(store) == {0: Host(2)}  # node 2's heartbeat is lost
    store.set(NODE_ALIVE_KEY.format(2), json.dumps({"alive": 3, "time": time.time()}))
    for m, node in (("a", 0), ("b", 2), ("c", 2), ("d", 2)):
        store.set(MEMBER_NODE_KEY.format(m), str(node))
    # node 0: 2 slots, 1 used; node 2: 4 slots, 3 used -> the tie goes to node 0, then node 2
    assert place_joiners(store, ["a", "b", "c", "d"], ["j0", "j1"]) == {"j0": 0, "j1": 2}
    with pytest.raises(ResizeRefusedError, match="node 0: 1 of 2 used, node 2: 3 of 4 used"):
        place_joiners(store, ["a", "b", "c", "d"], ["j0", "j1", "j2"])
    # a requester's check: 6 slots on the live hosts
    check_slots(store, 6)
    with pytest.raises(
        ResizeRefusedError, match=r"world size 7 needs 7 slots, but the job's hosts have 6 \(node 0: 2, node 2: 4\)"
    ):
        check_slots(store, 7)
    store.set(NODE_KEY.format(2), json.dumps({"slots": 4, "oversubscribe": True}))
    check_slots(store, 12)
    assert place_joiners(store, ["a", "b", "c", "d"], ["j0", "j1", "j2"]) == {"j0": 0, "j1": 2, "j2": 2}


def test_launch_context_round_trips_through_the_environment():
    ctx = LaunchContext("10.0.0.1", 29501, "g2r3", 2, 3, 4, 1, joiner=True, restore_dir="/snapshots")
    env = ctx.worker_environ()
    assert env["DYNATRAIN_RESTORE"] == "/snapshots" and env["RANK"] == "3" and env["WORLD_SIZE"] == "4"
    assert LaunchContext.from_environ(env) == ctx
    plain = LaunchContext("h", 1, "g0r0", 0, 0, 1, 0, joiner=False)
    assert "DYNATRAIN_RESTORE" not in plain.worker_environ()
    assert LaunchContext.from_environ(plain.worker_environ()) == plain
    assert LaunchContext.from_environ({}) is None


def test_entering_a_generation_keeps_the_local_rank():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    enter_generation(0, 2, 1, environ=env)
    assert env == {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def test_launch_starts_workers_with_huge_page_allocation_unless_the_environment_names_it(tmp_path, monkeypatch):
    """A real ``dynatrain launch`` of a one-process script that prints the variable torch reads:
    set to 1 by the launcher where absent, the caller's own value kept."""
    script = tmp_path / "show_env.py"
    script.write_text(f"import os\nprint('huge pages:', os.environ.get({HUGE_PAGES!r}), flush=True)\n")
    cfg = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1}
    monkeypatch.delenv(HUGE_PAGES, raising=False)
    job = launch(tmp_path, str(script), 1, cfg, timeout=60)
    assert job.returncode == 0, job.output
    assert "huge pages: 1" in job.output
    monkeypatch.setenv(HUGE_PAGES, "0")
    job = launch(tmp_path, str(script), 1, cfg, timeout=60, name="kept")
    assert job.returncode == 0, job.output
    assert "huge pages: 0" in job.output
