"""The restore of a job the launcher restarted after a worker died: the newest intact snapshot of
its snapshot directory, at whatever world size the restarted job has.

``latest`` names the newest committed snapshot; when its files turn out damaged (a checksum
mismatch, a truncated or missing rank file: storage can fail after a commit), the restore falls
back to the next older complete snapshot the directory keeps (``snapshot.keep_last``), and says
which it skipped and why, instead of ending the job.
"""

from __future__ import annotations

import os
import re
from typing import List, Tuple

from io_engine import TMP_PREFIX, BadLatestError, read_latest

from ..errors import CheckpointIncompleteError, SnapshotNotFoundError
from ..log import logger, plural
from .records import RestoreRecord

MODEL_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def _step_of(tag: str) -> int:
    m = re.search(r"(\d+)$", tag)
    return int(m.group(1)) if m else -1


def restore_candidates(snapshot_dir: str) -> Tuple[List[str], List[str]]:
    """The tags a restore of ``snapshot_dir`` tries, newest first: the one ``latest`` names, then
    every other published snapshot directory (one holding a model-state file, not a hidden
    temporary one), by the step number that ends its tag, largest first. Also returns why
    ``latest`` itself was unusable (empty when it was fine or absent).
    """
    problems: List[str] = []
    try:
        latest = read_latest(snapshot_dir) if os.path.isdir(snapshot_dir) else None
    except BadLatestError as err:
        latest, problems = None, [f"latest: {err}"]
    others = []
    if os.path.isdir(snapshot_dir):
        for name in os.listdir(snapshot_dir):
            path = os.path.join(snapshot_dir, name)
            if name == latest or name.startswith((".", TMP_PREFIX)) or not os.path.isdir(path):
                continue
            if any(os.path.isfile(os.path.join(path, f)) for f in MODEL_FILES):
                others.append(name)
    others.sort(key=lambda t: (_step_of(t), t), reverse=True)
    return ([latest] if latest else []) + others, problems


def check_restorable(snapshot_dir: str) -> List[str]:
    """The tags a restore of ``snapshot_dir`` would try, newest first (see
    :func:`restore_candidates`).

    Raises:
        SnapshotNotFoundError: the directory holds no published snapshot.
    """
    tags, problems = restore_candidates(snapshot_dir)
    if not tags:
        why = f" ({'; '.join(problems)})" if problems else ""
        raise SnapshotNotFoundError(
            f"no snapshot to restore from in {snapshot_dir}: it has no readable 'latest' and no snapshot "
            f"directory{why} (the job failed before its first snapshot was committed)"
        )
    return tags


def restore(engine, snapshot_dir: str) -> None:
    """Load the newest intact snapshot of ``snapshot_dir`` (any saving world size) into a job the
    launcher restarted after a worker died; log and record how many steps were lost and which
    newer snapshots were skipped as damaged. Collective: every rank tries the same tags in the
    same order, and a damaged file on one rank fails that tag on every rank (``load_checkpoint``
    agrees on it), so all ranks end on the same snapshot.

    Raises:
        SnapshotNotFoundError: no snapshot, or every one is damaged (each named with why), before
            training goes on.
        LayoutMismatchError: a snapshot of another model (no older one is tried: it would be too).
    """
    dt = engine._dt
    tags = check_restorable(snapshot_dir)
    _tags, skipped = restore_candidates(snapshot_dir)
    last = dt.membership.last_step()
    path = None
    for tag in tags:
        try:
            path, _client = engine.load_checkpoint(snapshot_dir, tag=tag)
        except CheckpointIncompleteError as err:
            skipped.append(f"{tag}: {err}")
            logger.warning(f"restore: snapshot {tag} of {snapshot_dir} is damaged, trying an older one: {err}")
            continue
        if path is not None:
            break
        skipped.append(f"{tag}: nothing was loaded")
    if path is None:
        raise SnapshotNotFoundError(
            f"no intact snapshot to restore from in {snapshot_dir}: " + "; ".join(skipped or ["none loaded"])
        )
    lost = max(0, last - engine.global_steps)
    if engine.global_rank == 0:
        dt.metrics.write(
            RestoreRecord(
                step=engine.global_steps,
                world_size=engine.dp_world_size,
                lost_steps=lost,
                last_step=last,
                dir=os.path.dirname(path),
                skipped=[s.split(":", 1)[0] for s in skipped],
                pipeline_parallel=dt.pp_layout.pp if dt.pp_layout is not None else None,
            )
        )
        instead = f" (skipped as damaged: {', '.join(s.split(':', 1)[0] for s in skipped)})" if skipped else ""
        logger.info(
            f"restored {os.path.dirname(path)} on {_where(engine)}{instead}: "
            "the job goes on after step "
            f"{engine.global_steps}; {plural(lost, 'step')} since that snapshot {'was' if lost == 1 else 'were'} lost"
        )


def _where(engine) -> str:
    """``"2 ranks"``; a pipeline job's ``"2 ranks (PP 2 x DP 1)"``."""
    layout = engine._dt.pp_layout
    if layout is None:
        return plural(engine.dp_world_size, "rank")
    return f"{plural(layout.world_size, 'rank')} (PP {layout.pp} x DP {layout.world_size // layout.pp})"
