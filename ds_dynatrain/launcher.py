"""The launcher agent: hosts the job's ``TCPStore`` and starts worker processes.

``dynatrain launch --nproc N --config CFG script.py [args...]`` runs ``script.py args...
--deepspeed_config CFG`` in N worker processes (the ``--deepspeed_config`` flag is DeepSpeed's
own convention, see ``deepspeed.add_config_arguments``). The agent, not a worker, hosts the
store, so that any worker may leave. While the job runs it starts the joiners that workers ask
for at a resize (store keys of :mod:`ds_dynatrain.membership`).

A worker that exits with status 0 has finished or left the job at a resize. When a worker fails
(killed without notice, or an error) and the job takes snapshots with ``restore_on_failure``, the
agent kills the others and restarts the job in a new generation on the largest world size the live
workers can serve, from the latest complete snapshot (``DYNATRAIN_RESTORE``; the workers load it
at that world size). Otherwise a failure ends the job: the others are killed and the agent exits
with the failing worker's status.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Dict, Optional, Sequence

import torch.distributed as tdist

from .launch_env import LaunchContext, member_id
from .membership import CANCEL_COUNT, CANCEL_KEY, ENDED_KEY, SPAWN_COUNT, SPAWN_KEY
from .metrics import logger

POLL_S = 0.05
GRACE_S = 10.0


class Agent:
    """Starts and watches the workers of one job on this host.

    Args:
        script: the training script.  script_args: its arguments.
        nproc: workers at launch.  config: path of the DeepSpeed config (passed on).
        store_host, store_port: where the store listens (port 0: any free port).
        python: interpreter for the workers.
    """

    def __init__(self, script: str, script_args: Sequence[str], nproc: int, config: str,
                 store_host: str = "127.0.0.1", store_port: int = 0, python: str = sys.executable,
                 restore_dir: Optional[str] = None, largest=None, max_restores: int = 3):
        self.script = script
        self.script_args = list(script_args)
        self.nproc = nproc
        self.config = config
        self.python = python
        self.store = tdist.TCPStore(store_host, store_port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60))
        self.store_host = store_host
        self.workers: Dict[str, subprocess.Popen] = {}
        self.exit_codes: Dict[str, int] = {}
        self._spawns_seen = 0
        self._cancels_seen = 0
        self._stopping = False
        self._stop_signal: Optional[int] = None
        self.restore_dir = restore_dir  # snapshots to restart from when a worker dies (None: do not)
        self.largest = largest or (lambda alive: alive)  # the largest world size <= alive that keeps the batch
        self.restores_left = max_restores
        self._restore_env = False

    @property
    def store_port(self) -> int:
        return self.store.port

    def _start(self, ctx: LaunchContext) -> None:
        env = dict(os.environ)
        env.update(ctx.worker_environ())
        env["MASTER_PORT"] = str(self.store_port)
        if self._restore_env:
            env["DYNATRAIN_RESTORE"] = self.restore_dir
        cmd = [self.python, self.script, *self.script_args, "--deepspeed_config", self.config]
        self.workers[ctx.member] = subprocess.Popen(cmd, env=env)

    def _poll_spawns(self) -> None:
        n = int(self.store.add(SPAWN_COUNT, 0))
        while self._spawns_seen < n:
            req = json.loads(self.store.get(SPAWN_KEY.format(self._spawns_seen)))
            self._spawns_seen += 1
            for rank, member in zip(req["ranks"], req["members"]):
                logger.info(f"agent: starting joiner {member} (rank {rank} of generation {req['generation']}, "
                            f"world size {req['world_size']})")
                self._start(LaunchContext(self.store_host, self.store_port, member, int(req["generation"]), int(rank),
                                          int(req["world_size"]), int(rank), joiner=True))

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
        self._stop_signal = signum
        self._stop_all(signal.Signals(signum))

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

    def _restart(self, dead: str, why: str) -> bool:
        """Restart the job from its latest snapshot on the live workers' number (or the largest
        size below it that keeps the global batch), in a new generation. False when it cannot."""
        from io_engine import read_latest
        from .membership import next_generation
        if self.restore_dir is None or self.restores_left <= 0 or read_latest(self.restore_dir) is None:
            return False
        alive = [m for m, p in self.workers.items() if m not in self.exit_codes and p.poll() is None]
        size = self.largest(len(alive))
        if size == 0:
            return False
        self.restores_left -= 1
        tag = read_latest(self.restore_dir)
        logger.info(f"agent: worker {dead} failed ({why}); restarting the job on {size} ranks from snapshot "
                    f"{tag} in {self.restore_dir}")
        for p in self.workers.values():
            if p.poll() is None:
                p.kill()
        for p in self.workers.values():
            p.wait()
        self.workers.clear()
        self.exit_codes.clear()
        g = next_generation(self.store)
        self._restore_env = True
        for r in range(size):
            self._start(LaunchContext(self.store_host, self.store_port, member_id(g, r), g, r, size, r, False))
        return True

    def run(self) -> int:
        """Start the job and wait for it. Returns 0 when every worker exited with 0, else the
        first failing worker's status."""
        for r in range(self.nproc):
            self._start(LaunchContext(self.store_host, self.store_port, member_id(0, r), 0, r, self.nproc, r, False))
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                if not self._stopping:
                    self._poll_cancels()
                    self._poll_spawns()
                for member, p in list(self.workers.items()):
                    if member in self.exit_codes:
                        continue
                    rc = p.poll()
                    if rc is None:
                        continue
                    self.exit_codes[member] = rc
                    if rc != 0 and not self._stopping:
                        self._poll_cancels()  # a cancelled joiner may have exited before we stopped it
                        if member not in self.workers:
                            continue
                        why = f"status {rc}" if rc > 0 else f"signal {signal.Signals(-rc).name}"
                        if self._restart(member, why):
                            break  # a new set of workers: look at them afresh
                        logger.info(f"agent: worker {member} failed ({why}); stopping the job")
                        # not SIGTERM: a worker takes that as a preemption notice and would wait for
                        # a step boundary its failed peer never reaches
                        self._stop_all(signal.SIGKILL)
                        return rc if rc > 0 else 128 - rc
                if len(self.exit_codes) == len(self.workers):
                    self._poll_cancels()
                    self._poll_spawns()
                    if len(self.exit_codes) == len(self.workers):
                        if self._stopping:
                            return 128 + (self._stop_signal or signal.SIGTERM)
                        if self.store.check([ENDED_KEY]):
                            logger.info(f"agent: every member was preempted after step "
                                        f"{self.store.get(ENDED_KEY).decode()}; the job did not finish")
                            return 128 + signal.SIGTERM
                        return 0
                time.sleep(POLL_S)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)


def launch(script: str, script_args: Sequence[str], nproc: int, config: str, store: Optional[str] = None) -> int:
    """Validate ``config``, then run the job under an :class:`Agent`. Returns the exit status."""
    from .config import ConfigError, load_ds_config
    from .initialize import check_elastic_config
    ds_config, dt_cfg = load_ds_config(config)  # refuse a bad config before any process starts
    global_batch, micro = check_elastic_config(ds_config, dt_cfg, nproc, elastic=True)
    host, port = "127.0.0.1", 0
    if store:
        host, _, p = store.rpartition(":")
        if not host or not p.isdigit() or not 0 <= int(p) < 65536:
            raise ConfigError(f"--store {store!r}: expected HOST:PORT with a port in 0-65535")
        port = int(p)
    restore = dt_cfg.snapshot.dir if dt_cfg.snapshot.interval_steps and dt_cfg.snapshot.restore_on_failure else None
    from .batch import largest_world_size

    def largest(alive: int) -> int:
        return largest_world_size(global_batch, micro, alive, dt_cfg.max_world_size)

    agent = Agent(script, script_args, nproc, config, host, port, restore_dir=restore, largest=largest)
    logger.info(f"agent: store at {host}:{agent.store_port}, starting {nproc} workers")
    return agent.run()
