"""The asynchronous snapshot engine on its own (one process, a real TCPStore, real files):
capture semantics, crash consistency under SIGKILL, and flat host memory over many snapshots."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as tdist
from conftest import ROOT
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from ds_dynatrain.checkpoint.snapshot import SnapshotCheckpointEngine
from io_engine import read_latest
from io_engine.host_cache import alloc_aligned
from state_providers.serialize import equal


@pytest.fixture
def store():
    st = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield st


def make_engine(store, **kw):
    kw.setdefault("timeout_s", 30)
    kw.setdefault("cache_bytes", 16 << 20)
    return SnapshotCheckpointEngine(store_address=("127.0.0.1", store.port), rank=0, world_size=1, **kw)


def save(engine, d, tag, state):
    info = CheckpointCommitInfo(tag=tag, save_dir=str(d), save_latest=True)
    engine.create(info)
    engine.makedirs(os.path.join(d, tag), exist_ok=True)
    engine.save(state, os.path.join(d, tag, "state.pt"))
    engine.commit(info)


def state_of(n=1 << 20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(n, generator=g),
        "h": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "odd": torch.ones(513, dtype=torch.float16),
        "step": 7,
        "lr": [1e-3, (0.9, 0.95)],
    }


def direct_ok(directory) -> bool:
    """Whether files in ``directory`` open with O_DIRECT (else the engine writes them buffered)."""
    probe = os.path.join(directory, ".probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        os.unlink(probe)
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "aligned, from_memory", [(False, True), (True, True), (True, False)], ids=["copied", "from-source", "copy-forced"]
)
def test_mutation_after_capture_never_reaches_the_file(store, tmp_path, aligned, from_memory):
    """``save`` returns at once; once the capture is done (what the elastic engine waits for right
    before the optimizer step) the live tensors may change and the file still holds the values
    of the moment of ``save``. ``from-source``: ``w`` lies in page-aligned memory, so it is
    written straight from there and the capture is the end of those writes; ``copied``: it lies 4
    bytes past a page, which no O_DIRECT file takes, so it is copied through the host cache (where
    the file system refuses O_DIRECT, buffered writes take any address: then it is written from
    there too); ``copy-forced``: it is aligned, but ``write_from_memory=False`` copies it."""
    engine = make_engine(store, write_from_memory=from_memory)
    state = state_of()
    if aligned:
        place = torch.frombuffer(alloc_aligned(state["w"].nbytes), dtype=torch.float32)
    else:  # one element past a page
        n = state["w"].numel()
        place = torch.frombuffer(alloc_aligned(state["w"].nbytes + 4), dtype=torch.float32)[1 : n + 1]
    state["w"] = place.copy_(state["w"])
    expected = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
    save(engine, tmp_path, "global_step1", state)
    engine.wait_captured()
    state["w"].add_(1.0)
    state["h"].zero_()
    engine.wait()
    loaded = engine.load(str(tmp_path / "global_step1" / "state.pt"))
    assert equal(loaded, expected)
    assert read_latest(str(tmp_path)) == "global_step1"
    buffered = not direct_ok(tmp_path)
    assert engine.stats["from_source_bytes"] == (state["w"].nbytes if (aligned or buffered) and from_memory else 0)
    engine.close()


def test_fifty_snapshots_keep_host_memory_flat(store, tmp_path):
    engine = make_engine(store, keep_last=2)
    state = state_of(1 << 18)
    rss = []
    for i in range(1, 51):
        state["w"].add_(1.0)
        save(engine, tmp_path, f"global_step{i}", state)
        engine.wait_captured()
        if i == 1:
            cache = engine._writer.cache
            buffers = (cache.num_buffers, cache.buffer_bytes)
        assert (engine._writer.cache.num_buffers, engine._writer.cache.buffer_bytes) == buffers
        with open("/proc/self/statm") as f:
            rss.append(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    engine.wait()
    assert sorted(x.name for x in tmp_path.iterdir() if not x.name.startswith(".")) == [
        "global_step49",
        "global_step50",
        "latest",
    ]
    loaded = engine.load(str(tmp_path / "global_step50" / "state.pt"))
    assert torch.equal(loaded["w"], state["w"])
    # after warm-up, 40 more snapshots of 1 MiB each may not grow the process by more than 16 MiB
    assert rss[-1] - rss[9] < 16 << 20, [r >> 20 for r in rss]
    engine.close()


KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {root!r}); sys.path.insert(0, os.path.join({root!r}, "tests"))
    from test_snapshot_engine import make_engine, save, state_of
    import torch.distributed as tdist
    store = tdist.TCPStore("127.0.0.1", int(sys.argv[2]), is_master=False, wait_for_workers=False)
    engine = make_engine(store)
    d = sys.argv[1]
    save(engine, d, "global_step1", state_of(seed=1))
    engine.wait()
    # INJECTED: the second snapshot's writes are slowed at the io seam so the kill lands mid-flush
    real = engine._writer.flusher.open
    def slow_open(path):
        session = real(path)
        write = session.write
        def slow_write(*a, **k):
            time.sleep(0.2)
            return write(*a, **k)
        session.write = slow_write
        return session
    engine._writer.flusher.open = slow_open
    save(engine, d, "global_step2", state_of(n=1 << 22, seed=2))
    print("flushing", flush=True)
    time.sleep(60)
""")


def test_process_killed_during_flush_leaves_latest_loadable(store, tmp_path):
    script = tmp_path / "kill_me.py"
    script.write_text(KILL_SCRIPT.format(root=ROOT))
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), str(store.port)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "flushing" not in line and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line and p.poll() is not None:
                break
        assert "flushing" in line, "the writer never reached the second snapshot"
        time.sleep(0.5)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert read_latest(str(tmp_path)) == "global_step1"
    assert not (tmp_path / "global_step2").exists()
    leftovers = [x.name for x in tmp_path.iterdir() if x.name.startswith(".tmp-global_step2")]
    assert leftovers, "the kill should have landed during the second snapshot's flush"
    engine = make_engine(store)
    loaded = engine.load(str(tmp_path / "global_step1" / "state.pt"))
    assert equal(loaded, state_of(seed=1))
    engine.close()


STORE_HOST = """
import sys, time
import torch.distributed as tdist
st = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(st.port, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_a_store_gone_after_the_commit_still_reports_the_snapshot_committed(tmp_path):
    """The job's store (a real ``TCPStore`` in a process of its own) is SIGKILLed after rank 0
    published the snapshot, before the training thread read the outcome, as when a job ends
    mid-snapshot: the store cannot answer, so the outcome is read off the files. The snapshot is
    committed (``latest`` names it, it loads equal to the state saved), so ``wait`` must not
    raise "not committed" and ``on_outcome`` gets ``ok``."""
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        engine = SnapshotCheckpointEngine(
            store_address=("127.0.0.1", port), rank=0, world_size=1, timeout_s=5, cache_bytes=16 << 20
        )
        outcomes = []
        engine.on_outcome = outcomes.append
        state = state_of()
        save(engine, tmp_path, "global_step3", state)
        deadline = time.monotonic() + 60
        while not (tmp_path / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert read_latest(str(tmp_path)) == "global_step3"
        host.kill()
        host.wait(30)
        engine.wait()  # the store is gone: the files say committed
        assert [o.ok for o in outcomes] == [True]
        engine.close()
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    loader = SnapshotCheckpointEngine(rank=0, world_size=1, cache_bytes=16 << 20)
    assert equal(loader.load(str(tmp_path / "global_step3" / "state.pt")), state)
    loader.close()


def test_published_reads_a_commit_off_the_files_only_when_they_are_this_saves(tmp_path):
    """:func:`published` (what the engine asks when the store cannot give an outcome) is true
    only for this save's files in the final directory with ``latest`` naming its tag: not while
    the temporary directory exists, not for an older snapshot of the same tag, not when
    ``latest`` names another tag, not for a file of another size."""
    from ds_dynatrain.checkpoint.snapshot import _FileJob, _Snapshot
    from ds_dynatrain.checkpoint.snapshot_outcome import published

    info = CheckpointCommitInfo(tag="global_step2", save_dir=str(tmp_path), save_latest=True)
    snap = _Snapshot(info, key="k", token="abc")
    os.makedirs(snap.tmp_dir)
    job = _FileJob(os.path.join(snap.tmp_dir, "state.pt"), provider=None)
    open(job.path, "wb").write(b"x" * 100)
    job.nbytes = 100
    snap.jobs.append(job)
    assert not published(snap)  # not renamed yet
    os.rename(snap.tmp_dir, snap.final_dir)
    assert not published(snap)  # no latest
    (tmp_path / "latest").write_text("global_step1")
    assert not published(snap)  # latest names another tag
    (tmp_path / "latest").write_text("global_step2")
    assert published(snap)
    job.nbytes = 99
    assert not published(snap)
    job.nbytes = 100
    old = time.time() - 3600
    os.utime(os.path.join(snap.final_dir, "state.pt"), (old, old))
    assert not published(snap)  # an older snapshot of the same tag
