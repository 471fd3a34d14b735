"""Bad snapshot storage is found before anything trains: ``io_engine.check_snapshot_dir`` on real
paths (a file, a path under a file, a read-only directory, a directory nobody may write), and
``dynatrain launch`` / ``ds_dynatrain.initialize`` refusing such a ``snapshot.dir`` with one line.

A read-only directory is made for real: with plain permissions when the tests run unprivileged,
and as root (where permissions stop no write) as a read-only bind mount in a private mount
namespace of the process under test (``unshare -m``; ``unshare -rm`` without privileges), so the
mount never reaches the rest of the machine. Only where neither is possible is that case skipped.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from typing import List, Optional

import pytest
from conftest import ROOT

from ds_dynatrain.config import check_snapshot_storage, parse_section
from ds_dynatrain.errors import ConfigError
from io_engine import IOBackend, IOConfig, StorageWriteError, check_snapshot_dir
from io_engine.storage_check import PROBE_PREFIX

CHECK = (
    "import json, sys\n"
    "from io_engine import check_snapshot_dir, StorageWriteError\n"
    "try:\n"
    "    check_snapshot_dir(sys.argv[1]); print(json.dumps({'ok': True}))\n"
    "except StorageWriteError as e:\n"
    "    print(json.dumps({'ok': False, 'type': type(e).__name__, 'message': str(e), 'errno': e.errno}))\n"
)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), DS_ACCELERATOR="cpu")


def _can_write(path) -> bool:
    try:
        with open(os.path.join(path, ".write-test"), "w"):
            pass
        os.unlink(os.path.join(path, ".write-test"))
        return True
    except OSError:
        return False


def read_only(path) -> Optional[List[str]]:
    """Make directory ``path`` read-only for a command: returns the argv prefix to run it with
    (``[]``: plain permissions suffice), or None when this machine offers no way."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        if not _can_write(path):
            return []
        os.chmod(path, 0o755)  # a privileged writer after all
    if not (shutil.which("unshare") and shutil.which("mount")):
        return None
    q = shlex.quote(str(path))
    script = f'mount --bind {q} {q} && mount -o remount,bind,ro {q} {q} && exec "$@"'
    for ns in (["unshare", "-m"], ["unshare", "-r", "-m"]):
        prefix = [*ns, "sh", "-c", script, "sh"]
        probe = subprocess.run([*prefix, "touch", os.path.join(path, ".ro-test")], capture_output=True, text=True)
        if probe.returncode != 0 and "Read-only file system" in probe.stderr:
            return prefix
    return None


# ---------------------------------------------------------------------------------------- the check


def test_a_missing_directory_is_created_and_the_probe_leaves_nothing(tmp_path):
    target = tmp_path / "a" / "b" / "snapshots"
    found = check_snapshot_dir(str(target))
    assert found.created and found.path == str(target) and target.is_dir()
    assert list(target.iterdir()) == []
    assert found.free_bytes > 0
    assert found.describe().startswith(f"snapshot directory {target}: created, writable, ")
    again = check_snapshot_dir(target)  # a path-like works too
    assert not again.created and again.direct == found.direct and list(target.iterdir()) == []


def test_a_file_is_not_a_directory(tmp_path):
    f = tmp_path / "snapshots"
    f.write_text("not a directory")
    with pytest.raises(StorageWriteError) as e:
        check_snapshot_dir(str(f))
    assert str(e.value) == f"{f}: exists and is a file, not a directory"
    assert f.read_text() == "not a directory"


def test_a_path_under_a_file_cannot_be_created(tmp_path):
    f = tmp_path / "plain"
    f.write_text("x")
    with pytest.raises(StorageWriteError) as e:
        check_snapshot_dir(str(f / "runs" / "snapshots"))
    assert str(e.value) == f"{f / 'runs' / 'snapshots'}: cannot be created: {f} is a file, not a directory"


def test_a_broken_symbolic_link_is_named(tmp_path):
    link = tmp_path / "snapshots"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(StorageWriteError, match="exists and is a broken symbolic link, not a directory"):
        check_snapshot_dir(str(link))


def test_an_empty_path_is_refused():
    with pytest.raises(StorageWriteError, match="an empty path names no directory"):
        check_snapshot_dir("")


def test_a_directory_nobody_may_write_is_refused():
    # /proc/self is a directory where no process, root included, may create a file
    with pytest.raises(StorageWriteError) as e:
        check_snapshot_dir("/proc/self")
    assert str(e.value).startswith("/proc/self: is not writable: creating a file there failed (E")


def test_a_directory_that_cannot_be_made_under_proc():
    with pytest.raises(StorageWriteError, match=r"^/proc/self/snapshots: cannot be created in /proc/self"):
        check_snapshot_dir("/proc/self/snapshots")


def test_a_read_only_directory_is_refused(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    prefix = read_only(d)
    if prefix is None:
        pytest.skip("no way to make a read-only directory here: not root-less, and no mount namespace")
    p = subprocess.run(
        [*prefix, sys.executable, "-c", CHECK, str(d)], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["ok"] is False and got["type"] == "StorageWriteError", got
    name = "EROFS" if prefix else "EACCES"
    assert got["message"].startswith(f"{d}: is not writable: creating a file there failed ({name})"), got
    assert list(d.iterdir()) == []


def test_o_direct_refused_at_open_chooses_buffered_writes(tmp_path):
    from faults import refuse_direct_open  # INJECTED: the file system refuses O_DIRECT (EINVAL at open)

    found = check_snapshot_dir(str(tmp_path), opener=refuse_direct_open)
    assert not found.direct and found.direct_refused == "O_DIRECT refused at open (EINVAL)"
    assert found.describe().endswith("buffered writes (O_DIRECT refused at open (EINVAL))")
    with pytest.raises(StorageWriteError, match="O_DIRECT was required but the file system refuses it"):
        check_snapshot_dir(str(tmp_path), direct=True, opener=refuse_direct_open)
    plain = check_snapshot_dir(str(tmp_path), direct=False)
    assert not plain.direct and plain.direct_refused == "O_DIRECT not asked for"
    assert [x for x in os.listdir(tmp_path) if x.startswith(PROBE_PREFIX)] == []


def test_through_a_backend_the_write_path_is_decided_and_logged_once(tmp_path):
    from faults import refuse_direct_open  # INJECTED: the file system refuses O_DIRECT (EINVAL at open)

    backend = IOBackend(IOConfig(), opener=refuse_direct_open)
    first = check_snapshot_dir(str(tmp_path), backend=backend)
    assert not first.direct and first.direct_refused == "O_DIRECT refused on this file system"
    assert len(backend.fallbacks) == 1 and "O_DIRECT refused" in backend.fallbacks[0]
    check_snapshot_dir(str(tmp_path), backend=backend)
    assert len(backend.fallbacks) == 1  # logged once
    fd, direct = backend.open_file(str(tmp_path / "snapshot-file"), write=True)  # the next file: decided
    os.close(fd)
    assert direct is False and len(backend.fallbacks) == 1
    direct_ok = check_snapshot_dir(str(tmp_path / "other"), backend=IOBackend())
    assert direct_ok.direct == check_snapshot_dir(str(tmp_path / "other")).direct


def test_the_config_check_gives_one_line_naming_the_key(tmp_path):
    assert check_snapshot_storage(parse_section({})) is None
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(ConfigError) as e:
        check_snapshot_storage(parse_section({"snapshot": {"interval_steps": 2, "dir": str(f)}}))
    assert str(e.value) == f"dynatrain.snapshot.dir: {f}: exists and is a file, not a directory"
    assert check_snapshot_storage(parse_section({"enabled": False, "snapshot": {"dir": str(f)}})) is None
    ok = check_snapshot_storage(parse_section({"snapshot": {"dir": str(tmp_path / "s")}}))
    assert ok is not None and ok.created


def test_on_write_error_is_strict():
    assert parse_section({}).snapshot.on_write_error == "warn"
    assert parse_section({"snapshot": {"on_write_error": "raise"}}).snapshot.on_write_error == "raise"
    with pytest.raises(ConfigError, match="dynatrain.snapshot.on_write_error"):
        parse_section({"snapshot": {"on_write_error": "ignore"}})


# -------------------------------------------------------------------- the launcher and initialize


def _bad_dir(tmp_path, case):
    """``(snapshot dir, argv prefix)`` for one kind of bad storage, or None when it cannot be made."""
    if case == "a file":
        f = tmp_path / "snapshots"
        f.write_text("")
        return str(f), []
    if case == "under a file":
        f = tmp_path / "plain"
        f.write_text("")
        return str(f / "snapshots"), []
    d = tmp_path / "ro"
    d.mkdir()
    prefix = read_only(d)
    return (str(d / "snapshots"), prefix) if prefix is not None else None


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "case, reason",
    [
        ("a file", "exists and is a file, not a directory"),
        ("under a file", "is a file, not a directory"),
        ("read-only", "cannot be created in"),
    ],
)
def test_launch_refuses_bad_storage_with_one_line_and_starts_nothing(tmp_path, case, reason):
    bad = _bad_dir(tmp_path, case)
    if bad is None:
        pytest.skip("no way to make a read-only directory here: not root-less, and no mount namespace")
    snap_dir, prefix = bad
    cfg = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "dynatrain": {"snapshot": {"interval_steps": 2, "dir": snap_dir}},
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(cfg))
    marker = tmp_path / "started"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "2", "--config", str(path), str(script)]
    p = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=180, cwd=ROOT, env=_env())
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"dynatrain launch: dynatrain.snapshot.dir: {snap_dir}: ") and reason in lines[0]
    assert not marker.exists()
    assert "agent: store at" not in p.stdout  # no agent, no worker


@pytest.mark.parametrize("case", ["a file", "under a file"])
def test_initialize_refuses_bad_storage_before_any_engine(tmp_path, case):
    import torch
    import torch.distributed as tdist

    import ds_dynatrain

    snap_dir, _prefix = _bad_dir(tmp_path, case)
    cfg = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 2,
        "dynatrain": {"snapshot": {"interval_steps": 2, "dir": snap_dir}},
    }
    model = torch.nn.Linear(3, 3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError) as e:
        ds_dynatrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert str(e.value).startswith(f"dynatrain.snapshot.dir: {snap_dir}: ") and "\n" not in str(e.value)
    assert not tdist.is_initialized()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
