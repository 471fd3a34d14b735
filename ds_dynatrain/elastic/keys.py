"""The keys of the job's ``TCPStore``: the one vocabulary the agents, the workers and the requesters
share (JSON values unless said otherwise).

Generations:

* ``dynatrain/gen/<g>``: ``{"generation", "world_size", "members", "step", "header_rank",
  "previous"}`` (:class:`~ds_dynatrain.elastic.membership.GenerationRecord`).
* ``dynatrain/gen/<g>/go``: set by rank 0 of the old generation when the members are about to
  form generation ``g``; joiners and standby processes wait for it before their rendezvous.
* ``dynatrain/gen/<g>/<step>/switching`` and ``.../abandoned``: the generation published at
  ``step`` forms now (its header is on its way) / will not be formed.
* ``dynatrain/pg|xfer/<g>/<step>/<digest>``: prefixes of one group formation (:func:`group_prefix`).

Processes:

* ``dynatrain/spawn/count`` (a counter) and ``dynatrain/spawn/<i>``: ``{"generation",
  "world_size", "ranks", "members", "nodes"}``, processes for the agents to start (``nodes``:
  member -> node id).
* ``dynatrain/cancel/count`` and ``dynatrain/cancel/<i>``: ``{"generation", "members"}``,
  joiners the agent must stop because their generation will not be formed.
* ``dynatrain/joiner/<member>/failed``: a joiner died before its generation formed.
* ``dynatrain/standby/<member>/gone``: a standby process left (preempted).
* ``dynatrain/dead/<member>``: ``{"why", "node"}``, a member died and the job recovers in place
  (``recovery.peer_replicas``); ``dynatrain/recovery/<member>/done`` or ``.../fallback``: the
  survivors recovered from it, or could not (``{"reason"}``: its agent restarts the job from the
  snapshot); ``dynatrain/recovery/<generation>/offer/<member>``: a survivor's copies
  (:mod:`~ds_dynatrain.engine.recover`).
* ``dynatrain/node/...``, ``dynatrain/member/<m>/node``, ``dynatrain/restart/...``: the agents'
  registry, heartbeats and published restarts (:mod:`~ds_dynatrain.elastic.agent`).

Requests and the job:

* ``dynatrain/job``: what a requester checks a world size against.
* ``dynatrain/batch``: ``{"args": [...], "kwargs": {...}}``, the shapes and dtypes (never the
  values) of rank 0's first forward inputs, from which a joiner builds its warm-up batch
  (:mod:`~ds_dynatrain.engine.warmup`).
* ``dynatrain/request/count`` and ``dynatrain/request/<i>``: ``{"world_size": N}`` from
  ``dynatrain resize`` (``"refill": true`` added when an agent grows the job back after a restart),
  or ``{"join": node, "slots": K}`` from ``dynatrain join``;
  ``dynatrain/request/<i>/answer``: ``{"ok", "message", "record", "aborted"}``;
  ``dynatrain/request/served``: requests answered so far.
* ``dynatrain/last_step``, ``dynatrain/done``, ``dynatrain/ended_by_preemption``.
* ``dynatrain/stop``: ``{"signal", "node"}``, an agent was sent SIGTERM or SIGINT: the job stops at
  its next step boundary; ``dynatrain/stopped``: ``{"step", "signal"}``, it did (rank 0).
* ``dynatrain/wave/<i>``: the port of the store that the ``i``-th set of workers started together
  (the launch, each restart) hands to a script's own ``init_process_group`` (node 0 hosts it).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

GEN_KEY = "dynatrain/gen/{}"
GO_KEY = "dynatrain/gen/{}/go"
ABANDONED_KEY = "dynatrain/gen/{}/{}/abandoned"  # generation, publishing step: will not be formed
SWITCH_KEY = "dynatrain/gen/{}/{}/switching"  # generation, publishing step: the header is on its way
JOB_KEY = "dynatrain/job"  # what a requester needs to check a world size
TRAINER_STATE_KEY = "dynatrain/frontend/trainer_state/{}"  # generation -> rank 0's Trainer state (JSON)
BATCH_KEY = "dynatrain/batch"  # shapes and dtypes of rank 0's first forward inputs (joiners' warm-up)
MODULES_KEY = "dynatrain/modules"  # modules rank 0 had imported after its first step (joiners import them early)
REQUEST_COUNT = "dynatrain/request/count"
REQUEST_KEY = "dynatrain/request/{}"  # {"world_size": N} or {"join": node, "slots": K}
ANSWER_KEY = "dynatrain/request/{}/answer"  # {"ok": bool, "message": str, "record": {...}, "aborted"}
SERVED_KEY = "dynatrain/request/served"  # requests answered so far (a restored job goes on from it)
LAST_STEP_KEY = "dynatrain/last_step"  # the last optimizer step the job completed
ENDED_KEY = "dynatrain/ended_by_preemption"  # every member was preempted: the job stopped early
DONE_KEY = "dynatrain/done"  # the job finished: standby processes leave
STOP_KEY = "dynatrain/stop"  # {"signal", "node"}: a launcher was told to stop the job
STOPPED_KEY = "dynatrain/stopped"  # {"step", "signal"}: the job stopped at that step boundary
WAVE_KEY = "dynatrain/wave/{}"  # port of the store of the scripts' own process groups, per start wave
SPAWN_COUNT = "dynatrain/spawn/count"
SPAWN_KEY = "dynatrain/spawn/{}"
CANCEL_COUNT = "dynatrain/cancel/count"
CANCEL_KEY = "dynatrain/cancel/{}"
STANDBY_GONE_KEY = "dynatrain/standby/{}/gone"  # a standby process left (preempted)
JOINER_FAILED_KEY = "dynatrain/joiner/{}/failed"  # a joiner died before its generation formed
NODE_COUNT = "dynatrain/node/count"  # agents registered (node ids 0 .. count-1)
NODE_KEY = "dynatrain/node/{}"  # {"slots": K, "oversubscribe": bool}: what that agent offers joiners
NODE_DONE_KEY = "dynatrain/node/{}/done"  # that agent's workers have all exited
NODE_ALIVE_KEY = "dynatrain/node/{}/alive"  # {"alive": running workers, "time": heartbeat, unix seconds}
MEMBER_NODE_KEY = "dynatrain/member/{}/node"  # the node a member runs on
DEAD_KEY = "dynatrain/dead/{}"  # {"why", "node"}: a member died; the survivors recover in place
LEFT_KEY = "dynatrain/left/{}/{}"  # generation, member: a leaver of its resize handed over and left
RECOVERED_KEY = "dynatrain/recovery/{}/done"  # dead member -> the recovery record (new rank 0)
FALLBACK_KEY = "dynatrain/recovery/{}/fallback"  # dead member -> {"reason"}: restart from the snapshot
OFFER_KEY = "dynatrain/recovery/{}/offer/{}"  # generation, member -> the copies it holds
SNAPSHOT_SEEN_KEY = (
    "dynatrain/recovery/{}/snapshot"  # generation -> the latest snapshot step, as the first survivor read it
)
RESTART_COUNT = "dynatrain/restart/count"
RESTART_KEY = "dynatrain/restart/{}"  # {"generation", "world_size", "ranks": {node: [ranks]}} or {"stop": rc}


def group_prefix(generation: int, members: Sequence[str], step: int, kind: str = "pg") -> str:
    """The store prefix of one group formation: its kind (``pg``: a generation's default group,
    ``xfer``: a transition's group), generation, the step it was published at and a digest of its
    members, so that an abandoned formation's keys never meet a later one's."""
    digest = hashlib.sha1(",".join(members).encode()).hexdigest()[:10]
    return f"dynatrain/{kind}/{generation}/{step}/{digest}"
