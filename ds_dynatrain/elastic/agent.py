"""The launcher agent: hosts the job's ``TCPStore`` and starts worker processes.

``dynatrain launch --nproc N --config CFG script.py [args...]`` runs ``script.py args...
--deepspeed_config CFG`` in N worker processes (the ``--deepspeed_config`` flag is DeepSpeed's
own convention, see ``deepspeed.add_config_arguments``). The agent, not a worker, hosts the
store, so that any worker may leave. While the job runs it starts the joiners that workers ask
for at a resize (store keys of :mod:`ds_dynatrain.elastic.keys`).

Several hosts: the same agent runs on each, ``dynatrain launch --nnodes N --node-rank R --nproc K
--store HOST:PORT``; node 0 hosts the store at HOST:PORT (an address of node 0 the others reach),
node R starts ranks ``R*K .. R*K+K-1`` (under ``srun`` or on Kubernetes the node count, rank and
store host come from the scheduler's variables: :mod:`~ds_dynatrain.elastic.cluster_env`).
``dynatrain join --store HOST:PORT --nproc K`` starts an agent on one more host that asks the job
to grow by K ranks there (a request in the same queue as ``dynatrain resize``). Joiners of a grow
start on the host the request names, else in the free slots of the host with the most (each agent
offers ``--slots``, default ``--nproc``; never past them without ``--allow-oversubscribe``:
:mod:`~ds_dynatrain.elastic.placement`). Node 0's agent keeps the store up until every agent's
workers have exited.

A worker that exits with status 0 has finished or left the job at a resize. When a worker fails
(killed without notice, or an error; a whole host lost makes its peers fail within
``collective_timeout_s``) and the job takes snapshots with ``restore_on_failure``, its agent
publishes a restart: every agent kills its workers and starts its share of a new generation on the
largest world size the live workers can serve, from the latest complete snapshot
(``DYNATRAIN_RESTORE``; the workers load it at that world size); with ``--max-refills N`` that
agent then asks the job to grow back to its slots (:mod:`~ds_dynatrain.elastic.refill`). Otherwise
a failure ends the job: every agent kills its workers and exits with the failing worker's status.

SIGTERM or SIGINT to an agent (a scheduler ending the job, Ctrl-C) stops the whole job: the agent
marks the stop in the store, rank 0 reads it at the next step boundary and the step's vote carries
it to every rank, which takes a final snapshot there and exits with status 0; the agents exit with
128 + the signal. The agent tells the workers through the store rather than by signal: SIGTERM to
a worker already means that *this one* worker is preempted (it leaves, the job shrinks), a signal
reaches a process only once it has installed a handler (one still importing torch would die), and
the store reaches every rank of every host at the same step. Workers start with SIGINT ignored (a
terminal's Ctrl-C reaches the whole foreground process group; the agent alone decides what it
means). A second signal to the agent kills the workers at once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Dict, Optional, Sequence

import torch.distributed as tdist

from ..log import logger, plural
from .keys import (
    ANSWER_KEY,
    CANCEL_COUNT,
    CANCEL_KEY,
    ENDED_KEY,
    GEN_KEY,
    JOINER_FAILED_KEY,
    MEMBER_NODE_KEY,
    NODE_ALIVE_KEY,
    NODE_COUNT,
    NODE_DONE_KEY,
    NODE_KEY,
    REQUEST_COUNT,
    REQUEST_KEY,
    RESTART_COUNT,
    RESTART_KEY,
    SPAWN_COUNT,
    SPAWN_KEY,
    STOP_KEY,
    STOPPED_KEY,
    SWITCH_KEY,
    WAVE_KEY,
)
from .launch_env import LaunchContext, member_id, with_huge_pages
from .membership import connect_store, next_generation
from .placement import alive_workers, others_running
from .priority import joiner_start_env
from .recovery_watch import RecoveryWatch
from .refill import Refill
from .restart import latest_tag, post_restart, restart_ranks

POLL_S = 0.05
GRACE_S = 10.0


def _before_exec(nice: int = 0) -> None:
    """In a worker, between fork and exec: SIGINT ignored (kept through exec; Python then installs
    no KeyboardInterrupt handler), and the nice value raised by ``nice`` (a joiner)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if nice:
        os.nice(nice)


class Agent:
    """Starts and watches the workers of one job on this host.

    Args:
        script: the training script.  script_args: its arguments.
        nproc: workers at launch.  config: path of the DeepSpeed config (passed on; None: the script's
            own arguments name it).
        store_host, store_port: where the store listens (port 0: any free port).
        python: interpreter for the workers.  slots, oversubscribe: what this host offers joiners
        (:class:`~ds_dynatrain.elastic.placement.Host`; default ``nproc`` slots, not past them).
        max_refills: grows back to the slots after a restart shrank the job (0: none).
        joiner_nice: joiners start this much above the agent's nice value until their generation
            forms (:mod:`~ds_dynatrain.elastic.priority`; 0: unchanged).
        recovery_timeout_s: ``recovery.timeout_s`` when the job keeps peer replicas: a worker's
            death is reported to the survivors (:mod:`~ds_dynatrain.elastic.recovery_watch`).
    """

    def __init__(
        self,
        script: str,
        script_args: Sequence[str],
        nproc: int,
        config: Optional[str],
        store_host: str = "127.0.0.1",
        store_port: int = 0,
        python: str = sys.executable,
        restore_dir: Optional[str] = None,
        largest=None,
        max_restores: int = 3,
        nnodes: int = 1,
        node_rank: int = 0,
        join: bool = False,
        connect_timeout_s: float = 60.0,
        slots: Optional[int] = None,
        oversubscribe: bool = False,
        max_refills: int = 0,
        joiner_nice: int = 0,
        recovery_timeout_s: Optional[float] = None,
    ):
        self.script = script
        self.script_args = list(script_args)
        self.nproc = nproc
        self.config_args = ["--deepspeed_config", config] if config else []
        self.python = python
        self.nnodes = nnodes
        self.joining = join
        self.master = node_rank == 0 and not join
        if self.master:
            self.store = tdist.TCPStore(
                store_host, store_port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
            )
            self.store.add(NODE_COUNT, nnodes)
        else:
            self.store = connect_store(store_host, store_port, connect_timeout_s, quiet=True)
        self.node = int(self.store.add(NODE_COUNT, 1)) - 1 if join else node_rank
        self.slots = nproc if slots is None else slots
        self.store.set(NODE_KEY.format(self.node), json.dumps({"slots": self.slots, "oversubscribe": oversubscribe}))
        self.store_host = store_host
        self._restarts_seen = 0
        self.local_ranks: Dict[str, int] = {}
        self.joiner_of: Dict[str, int] = {}  # joiners this agent started -> their generation
        self._join_request: Optional[int] = None
        self.workers: Dict[str, subprocess.Popen] = {}
        self.exit_codes: Dict[str, int] = {}
        self._spawns_seen = 0
        self._cancels_seen = 0
        self._stopping = False  # a signal asked the job to stop at its next step boundary
        self._stop_signal: Optional[int] = None
        self._killed = False  # a second signal: the workers were killed
        self._wave_stores: Dict[int, tdist.TCPStore] = {}  # node 0: the scripts' own stores, per start wave
        self.restore_dir = restore_dir  # snapshots to restart from when a worker dies (None: do not)
        self.largest = largest or (lambda alive: alive)  # the largest world size <= alive that keeps the batch
        self.restores_left = max_restores
        self.refill = Refill(self.store, max_refills, self.largest)  # grow back after a restart shrank the job
        self._restore_env = False
        self.joiner_env = joiner_start_env(joiner_nice)  # joiners start below the workers (priority.py)
        self.joiner_nice = joiner_nice
        # in-place recovery (recovery.peer_replicas): a death is reported to the survivors, not restarted
        self.recovery = None if recovery_timeout_s is None else RecoveryWatch(self.store, self.node, recovery_timeout_s)

    @property
    def store_port(self) -> int:
        return self.store.port

    def _wave_port(self, wave: int) -> int:
        """The port of the store that the processes of start ``wave`` (0: the launch, i: the i-th
        restart) hand a script's own ``init_process_group`` (node 0 hosts one per wave, so a
        restart never meets the keys of the group before it)."""
        key = WAVE_KEY.format(wave)
        if self.master and wave not in self._wave_stores:
            st = tdist.TCPStore(
                self.store_host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
            )
            self._wave_stores[wave] = st
            self.store.set(key, str(st.port))
        self.store.wait([key], timedelta(seconds=60))
        return int(self.store.get(key))

    def _start(self, ctx: LaunchContext, wave: Optional[int] = None) -> None:
        """Start the worker of ``ctx``; ``wave``: the start it belongs to (None: a joiner)."""
        if self._killed:
            return
        # the local rank is this host's own index of the process (its device), whatever its rank
        used = {self.local_ranks.get(m) for m, p in self.workers.items() if p.poll() is None}
        local = next(i for i in range(len(used) + 1) if i not in used)
        self.local_ranks[ctx.member] = local
        ctx = dataclasses.replace(ctx, local_rank=local)
        if self._restore_env:
            ctx = dataclasses.replace(ctx, restore_dir=self.restore_dir)
        env = with_huge_pages(dict(os.environ))
        env.update(ctx.worker_environ(0 if wave is None else self._wave_port(wave)))
        cmd = [self.python, self.script, *self.script_args, *self.config_args]
        self.store.set(MEMBER_NODE_KEY.format(ctx.member), str(self.node))
        nice = self.joiner_nice if ctx.joiner and self.joiner_env else 0
        env.update(self.joiner_env if nice else {})
        self.workers[ctx.member] = subprocess.Popen(cmd, env=env, preexec_fn=functools.partial(_before_exec, nice))

    def _poll_spawns(self) -> None:
        n = int(self.store.add(SPAWN_COUNT, 0))
        while self._spawns_seen < n:
            req = json.loads(self.store.get(SPAWN_KEY.format(self._spawns_seen)))
            self._spawns_seen += 1
            nodes = req.get("nodes") or {}
            for rank, member in zip(req["ranks"], req["members"]):
                if int(nodes.get(member, 0)) != self.node:
                    continue
                logger.info(
                    f"agent: starting joiner {member} (rank {rank} of generation {req['generation']}, "
                    f"world size {req['world_size']})"
                )
                self.joiner_of[member] = int(req["generation"])
                self._start(
                    LaunchContext(
                        self.store_host,
                        self.store_port,
                        member,
                        int(req["generation"]),
                        int(rank),
                        int(req["world_size"]),
                        int(rank),
                        joiner=True,
                    )
                )

    def _poll_cancels(self) -> None:
        """Stop joiners whose generation will not be formed; their exit status does not count."""
        n = int(self.store.add(CANCEL_COUNT, 0))
        while self._cancels_seen < n:
            req = json.loads(self.store.get(CANCEL_KEY.format(self._cancels_seen)))
            self._cancels_seen += 1
            for member in req["members"]:
                p = self.workers.pop(member, None)
                self.exit_codes.pop(member, None)
                if p is None:
                    continue
                logger.info(f"agent: stopping joiner {member}: generation {req['generation']} will not be formed")
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(timeout=GRACE_S)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()

    def _on_signal(self, signum, _frame) -> None:
        """SIGTERM/SIGINT: the job stops at its next step boundary (after a final snapshot); a
        second one kills the workers at once."""
        name = signal.Signals(signum).name
        if self._stopping:
            logger.info(f"agent: {name} again: killing the workers now")
            self._killed = True
            for p in self.workers.values():
                if p.poll() is None:
                    p.kill()
            return
        self._stopping, self._stop_signal = True, signum
        self.store.set(STOP_KEY, json.dumps({"signal": int(signum), "node": self.node}))
        logger.info(
            f"agent: {name}: the job stops at its next step boundary, after a final snapshot when it "
            "takes snapshots (a second signal kills it at once)"
        )

    def _stop_all(self, sig=signal.SIGTERM) -> None:
        self._stopping = True
        for p in self.workers.values():
            if p.poll() is None:
                p.send_signal(sig)
        deadline = time.monotonic() + GRACE_S
        for p in self.workers.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _died_before_joining(self, member: str) -> bool:
        """A joiner that died before its generation started forming held no state: the job gives
        the request up (rank 0 reads the mark) instead of stopping or restarting."""
        g = self.joiner_of.get(member)
        if g is None or not self.store.check([GEN_KEY.format(g)]):
            return False
        step = json.loads(self.store.get(GEN_KEY.format(g)))["step"]
        if self.store.check([SWITCH_KEY.format(g, step)]):
            return False
        self.store.set(JOINER_FAILED_KEY.format(member), "1")
        return True

    def _publish_alive(self) -> None:
        """This node's running workers and a heartbeat (for the restart size and node 0's wait)."""
        alive = sum(1 for m, p in self.workers.items() if m not in self.exit_codes and p.poll() is None)
        now = time.monotonic()
        if alive != getattr(self, "_alive_sent", None) or now - getattr(self, "_beat_sent", 0.0) > 1.0:
            self.store.set(NODE_ALIVE_KEY.format(self.node), json.dumps({"alive": alive, "time": time.time()}))
            self._alive_sent, self._beat_sent = alive, now

    def _restart(self, dead: str, why: str) -> bool:
        """Publish a restart of the job from its latest snapshot on the live workers of every node
        (or the largest size below their number that keeps the global batch), in a new
        generation; every agent applies it (:meth:`_poll_restarts`). False when it cannot."""
        if self.restore_dir is None or self.restores_left <= 0 or latest_tag(self.restore_dir) is None:
            return False
        self._publish_alive()
        alive = alive_workers(self.store, self.node)  # a lost host serves nothing
        size = self.largest(sum(alive.values()))
        if size == 0:
            return False
        logger.info(
            f"agent: worker {dead} failed ({why}); restarting the job on {plural(size, 'rank')} from snapshot "
            f"{latest_tag(self.restore_dir)} in {self.restore_dir}"
        )
        rec = {"generation": next_generation(self.store), "world_size": size, "ranks": restart_ranks(alive, size)}
        post_restart(self.store, rec)
        self.refill.after_restart(size)
        return True

    def _poll_restarts(self) -> Optional[int]:
        """Apply restarts published by any agent: kill this node's workers, start its share of the
        new generation. Returns an exit status when the job was stopped instead."""
        n = int(self.store.add(RESTART_COUNT, 0))
        while self._restarts_seen < n:
            rec = json.loads(self.store.get(RESTART_KEY.format(self._restarts_seen)))
            self._restarts_seen += 1
            for p in self.workers.values():
                if p.poll() is None:
                    p.kill()
            for p in self.workers.values():
                p.wait()
            self.workers.clear()
            self.exit_codes.clear()
            if "stop" in rec:
                return int(rec["stop"])
            self.restores_left -= 1
            self._restore_env = True
            g, size = int(rec["generation"]), int(rec["world_size"])
            for r in rec["ranks"].get(str(self.node), []):
                ctx = LaunchContext(self.store_host, self.store_port, member_id(g, r), g, r, size, r, False)
                self._start(ctx, wave=self._restarts_seen)
        return None

    def _request_join(self) -> None:
        """``dynatrain join``: ask the job to grow by this node's slots, joiners placed here."""
        i = int(self.store.add(REQUEST_COUNT, 1)) - 1
        self.store.set(REQUEST_KEY.format(i), json.dumps({"join": self.node, "slots": self.nproc}))
        self._join_request = i
        logger.info(f"agent: node {self.node} asks the job to grow by {plural(self.nproc, 'rank')} (request {i})")

    def _join_refused(self) -> Optional[str]:
        if self._join_request is None or not self.store.check([ANSWER_KEY.format(self._join_request)]):
            return None
        answer = json.loads(self.store.get(ANSWER_KEY.format(self._join_request)))
        self._join_request = None
        return None if answer["ok"] else answer["message"]

    def _end(self, rc: int) -> int:
        self.store.set(NODE_DONE_KEY.format(self.node), str(rc))
        if self.master and not self._killed:
            while others_running(self.store, self.node):  # the store must outlive every node's workers
                time.sleep(POLL_S * 4)
        return rc

    def _final_status(self) -> int:
        """Every worker of this node has exited: the job's status from here."""
        if self.store.check([ENDED_KEY]):
            logger.info(
                f"agent: every member was preempted after step {self.store.get(ENDED_KEY).decode()}; "
                "the job did not finish"
            )
            return 128 + signal.SIGTERM
        if self.store.check([STOPPED_KEY]):
            stop = json.loads(self.store.get(STOPPED_KEY))
            logger.info(f"agent: the job was stopped after step {stop['step']} ({signal.Signals(stop['signal']).name})")
            return 128 + int(stop["signal"])
        if self._killed or (self._stopping and any(self.exit_codes.values())):
            return 128 + (self._stop_signal or signal.SIGTERM)
        return 0  # also when a signal came after the last step boundary: the job had finished

    def _watch(self, member: str, rc: int) -> Optional[int]:
        """A worker exited with ``rc`` != 0. Returns the status to end this agent with, -1 when the
        loop must look afresh (a restart), None when the job goes on."""
        self._poll_cancels()  # a cancelled joiner may have exited before we stopped it
        if member not in self.workers:
            return None
        why = f"status {rc}" if rc > 0 else f"signal {signal.Signals(-rc).name}"
        if self._died_before_joining(member):
            logger.info(
                f"agent: joiner {member} died before it joined ({why}); the job gives its generation up and goes on"
            )
            return None
        if self._stopping:  # its peers would wait for it at the stop's boundary
            logger.info(f"agent: worker {member} failed ({why}) while the job was stopping; killing the others")
            self._stop_all(signal.SIGKILL)
            return self._end(128 + (self._stop_signal or signal.SIGTERM))
        if self.recovery is not None:
            self.recovery.report(member, why, rc)  # the survivors go on in place (recovery_watch)
            return None
        return self._fail(member, why, rc)

    def _fail(self, member: str, why: str, rc: int) -> Optional[int]:
        """Restart the job from its snapshot after ``member`` failed, or stop it (as :meth:`_watch`)."""
        seen = self._restarts_seen
        stopped = self._poll_restarts()
        if stopped is not None:
            return self._end(stopped)
        if self._restarts_seen != seen or not self.workers:
            return -1  # another agent restarted the job first: look afresh
        if self._restart(member, why):
            return -1  # the restart is applied at the top of the loop
        logger.info(f"agent: worker {member} failed ({why}); stopping the job")
        code = rc if rc > 0 else 128 - rc
        post_restart(self.store, {"stop": code})
        # not SIGTERM: a worker takes that as a preemption notice and would wait for a step
        # boundary its failed peer never reaches
        self._stop_all(signal.SIGKILL)
        return self._end(code)

    def _poll(self) -> Optional[int]:
        """What the store asks of this agent; a status to end with, or None."""
        if self._killed:
            return None
        if not self._stopping:  # a stopping job restarts nothing; it may still be mid-resize
            stopped = self._poll_restarts()
            if stopped is not None:
                return self._end(stopped)
        self._poll_cancels()
        self._poll_spawns()
        self.refill.poll()
        live = lambda: sum(alive_workers(self.store, self.node).values())  # noqa: E731
        for member, why, rc, reason in self.recovery.poll(live) if self.recovery is not None else ():
            logger.info(f"agent: no in-place recovery from {member}: {reason}")
            ended = self._fail(member, why, rc)
            if ended is not None and ended != -1:
                return ended
        refused = self._join_refused()
        if refused:
            logger.info(f"agent: the job refused to grow: {refused}")
            return self._end(2)
        return None

    def run(self) -> int:
        """Start this node's workers and wait for them. Returns 0 when every worker exited with 0,
        128 + the signal when SIGTERM or SIGINT stopped the job, else the first failing worker's
        status."""
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.joining:
                self._request_join()
            else:
                world = self.nproc * self.nnodes
                for r in range(self.node * self.nproc, (self.node + 1) * self.nproc):
                    self._start(
                        LaunchContext(self.store_host, self.store_port, member_id(0, r), 0, r, world, r, False), 0
                    )
            while True:
                ended = self._poll()
                if ended is not None:
                    return ended
                self._publish_alive()
                for member, p in list(self.workers.items()):
                    rc = p.poll() if member not in self.exit_codes else None
                    if rc is None:
                        continue
                    self.exit_codes[member] = rc
                    if rc != 0 and not self._killed:
                        ended = self._watch(member, rc)
                        if ended == -1:
                            break
                        if ended is not None:
                            return ended
                waiting_for_join = self.joining and self._join_request is not None
                # a reported death still awaits the survivors' answer: the next poll decides (restart)
                awaiting_recovery = self.recovery is not None and bool(self.recovery.waiting)
                if len(self.exit_codes) == len(self.workers) and not waiting_for_join and not awaiting_recovery:
                    if not self._killed:
                        self._poll_cancels()
                        self._poll_spawns()
                    if len(self.exit_codes) == len(self.workers):
                        self._publish_alive()
                        return self._end(self._final_status())
                time.sleep(POLL_S)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
