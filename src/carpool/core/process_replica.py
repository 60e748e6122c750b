"""Replicas in their own processes (``executor="process"``).

A model that holds the GIL (pure-Python pre- or post-processing, many scikit-learn
predictors) gets one core however many thread replicas it has. A :class:`ProcessReplica`
runs its copy of the model in a child process started with the ``spawn`` context (not
forked after torch or threads started), behind the same ``start(call)`` interface as a
thread replica: the batcher, its queues and the pull-based dispatch stay in this process.

What crosses, and how (see :mod:`carpool.core.shm_ring`): the collated batch is written
into this replica's shared-memory region and a small header goes over a pipe; the child
builds NumPy views on it, calls the model, writes the outputs into its own region and
answers with a header; this side copies them out. Payloads or outputs that are not NumPy
arrays (or a dict of them) are pickled over the pipe instead.

Death: the child's exit is watched on the event loop (its ``sentinel``), so a crash,
``kill -9`` or the OOM killer is seen at once. The call it ran is tried once on another
live replica, else its requests fail with a :class:`~carpool.errors.ModelError` naming
the exit code or signal (:class:`~carpool.errors.ReplicaDied`); the replica is started
again after ``RESTART_WAIT_S``, doubling to ``RESTART_WAIT_MAX_S`` while starts keep
failing, and each restart is counted (``ReplicaCounters.num_restarts``). A call that runs
past ``batch_timeout_s`` fails with ``BatchTimeout`` as on a thread, and its process is
killed (SIGKILL) and restarted: a process can be stopped, where a thread could not. A
model that raises fails only that call (as on a thread); the process goes on serving.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from carpool.core.allocator import tune_malloc
from carpool.core.model_call import ModelCall, RunOutput
from carpool.core.model_source import ModelSource, build_from_source
from carpool.core.remote_replica import (
    RESTART_WAIT_MAX_S,
    RESTART_WAIT_S,
    ChildState,
    RemoteReplica,
)
from carpool.core.shm_ring import Reader, Region
from carpool.core.stepwise import run_to_end
from carpool.core.watchdog import Watchdog
from carpool.errors import ConfigError, ReplicaDied

log = logging.getLogger("carpool.replicas")

SPAWN = multiprocessing.get_context("spawn")
STOP_WAIT_S = 2.0  # how long a child may take to end after it was asked to

_children: weakref.WeakSet[BaseProcess] = weakref.WeakSet()


@atexit.register
def _kill_children() -> None:
    """No replica process outlives this one (a batcher never stopped, an interpreter
    that exits on an exception)."""
    for process in list(_children):
        if process.is_alive():
            process.kill()


def check_replica_cpus(replica_cpus: object, num_replicas: int) -> list[list[int]] | None:
    """``replica_cpus``: one list of CPU numbers per replica, or None.

    Raises:
        ConfigError: not a list of ``num_replicas`` non-empty lists of CPU numbers.
    """
    if replica_cpus is None:
        return None
    expected = f"{num_replicas} lists of CPU numbers, one per replica, as [[0], [1]]"
    if not isinstance(replica_cpus, list | tuple) or len(replica_cpus) != num_replicas:
        raise ConfigError("replica_cpus", replica_cpus, expected)
    cpus: list[list[int]] = []
    for entry in replica_cpus:
        if (
            not isinstance(entry, list | tuple)
            or not entry
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in entry)
        ):
            raise ConfigError("replica_cpus", replica_cpus, expected)
        cpus.append(list(entry))
    wanted = {c for entry in cpus for c in entry}
    outside = sorted(wanted - _pinnable(wanted))
    if outside:  # the child's sched_setaffinity would fail, after the parent said nothing
        raise ConfigError(
            "replica_cpus",
            replica_cpus,
            f"CPUs a process may be pinned to on this machine; {outside} are not among them",
        )
    return cpus


def _pinnable(cpus: set[int]) -> set[int]:
    """Of ``cpus``, those a replica's process could pin itself to: its cpuset's (a
    ``taskset`` mask narrower than it binds the server, not the replica, which may widen
    its own). Asked of the kernel by pinning this thread to each in turn, then back;
    all of them where the platform cannot say."""
    try:
        mask = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return cpus
    found = set()
    try:
        for cpu in cpus:
            try:
                os.sched_setaffinity(0, {cpu})
            except (OSError, ValueError, OverflowError):
                continue
            found.add(cpu)
    finally:
        os.sched_setaffinity(0, mask)
    return found


# -- the child ------------------------------------------------------------------------


def _match_torch_threads(cpus: list[int] | None) -> None:
    torch = sys.modules.get("torch")
    if cpus is not None and torch is not None:
        torch.set_num_threads(len(cpus))


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling both ways, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def child_main(conn: Connection, source: ModelSource, device: str, cpus: list[int] | None) -> None:
    """A replica process: build the model, then run each batch the pipe announces.

    It ignores SIGINT and SIGTERM: Ctrl-C in a terminal, or a service manager that signals
    every process of the server, must not end it under a batch the server is draining;
    the server ends it (``None`` on the pipe, or SIGKILL), and it ends by itself when the
    pipe closes (the server died)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tune_malloc()  # its batches' arrays, as in the server (carpool.core.allocator)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    _match_torch_threads(cpus)
    try:
        fn = build_from_source(source, device)
    except ConfigError as exc:  # the model's key and why, as a thread replica says it
        conn.send(("failed", exc))
        return
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    _match_torch_threads(cpus)  # the factory may have imported torch
    conn.send(("ready", os.getpid()))
    reader, region = Reader(), Region()
    try:
        while True:
            try:
                header = conn.recv()
            except EOFError:
                return
            if header is None:
                return
            batch = reader.read(header, copy=False)
            try:
                outputs = run_to_end(fn(batch))
            except Exception as exc:
                del batch
                conn.send(("raised", _portable(exc)))
                continue
            del batch
            try:
                conn.send(("ok", region.write(outputs)))
            except Exception as exc:  # outputs that cannot be pickled
                conn.send(("raised", _portable(exc)))
    finally:
        reader.close()
        region.close()


# -- this side ------------------------------------------------------------------------


class ProcessReplica(RemoteReplica):
    """One copy of the model in its own process (see the module docstring). ``group``
    lists the model's process replicas: a call whose process died runs again on another."""

    def __init__(
        self,
        replica_id: int,
        device: str,
        name: str,
        source: ModelSource,
        now: Callable[[], float],
        watchdog: Watchdog | None,
        cpus: list[int] | None,
        group: list[ProcessReplica],
    ) -> None:
        super().__init__(replica_id, device, name, now, watchdog, group)
        self._source = source
        self._cpus = cpus
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: asyncio.Future[Any] | None = None  # the reply awaited
        self._region = Region()  # batches to the child
        self._reader = Reader()  # outputs from it

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None else process.pid

    async def load(self) -> None:
        """Start the process and wait for its model.

        Raises:
            ConfigError: the model's source refused to build it (a factory that raised).
            RuntimeError: the model failed to build there otherwise, or the process died
                first.
        """
        await self._spawn()

    async def _spawn(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        conn, child_conn = SPAWN.Pipe()
        process = SPAWN.Process(
            target=child_main,
            args=(child_conn, self._source, self.device, self._cpus),
            name=f"carpool-{self._name}-r{self.replica_id}",
            daemon=True,
        )
        process.start()
        child_conn.close()
        _children.add(process)
        self._process, self._conn, self._state = process, conn, ChildState.STARTING
        ready = self._pending = loop.create_future()
        loop.add_reader(conn.fileno(), self._on_readable)
        loop.add_reader(process.sentinel, self._on_exit)
        try:
            await ready
            if self._state is not ChildState.STARTING:
                # It said ready, then died before this resumed: _on_exit, seeing it
                # start, left the restart to this caller.
                raise ReplicaDied(self._name, self.replica_id, self._exitcode())
        except ReplicaDied as died:
            self._discard()
            raise RuntimeError(
                f"model {self._name!r}, replica {self.replica_id}: its process ended before "
                f"it could serve (exit code {died.exitcode}); see its output above"
            ) from None
        except BaseException:
            self._discard()
            raise
        self._state = ChildState.READY

    def _on_readable(self) -> None:
        if not self._read_replies():
            self._on_exit()  # its end of the pipe closed: it died

    def _read_replies(self) -> bool:
        """Deliver the messages waiting on the pipe; False once it is closed."""
        conn = self._conn
        try:
            while conn is not None and conn.poll():
                self._deliver(conn.recv())
        except (EOFError, OSError):
            return False
        return True

    def _deliver(self, message: tuple[str, Any]) -> None:
        pending, self._pending = self._pending, None
        if pending is None or pending.done():
            return  # the answer to a call given up (past batch_timeout_s)
        kind, body = message
        if kind == "ok":
            # Copied out now: should the child end in this same loop turn, _on_exit
            # unlinks its output region before the call awaiting ``pending`` resumes.
            try:
                outputs = self._reader.read(body, copy=True)
            except Exception as error:  # its region could not be read
                pending.set_exception(error)
            else:
                pending.set_result(outputs)
        elif kind == "ready":
            pending.set_result(None)
        elif kind == "raised":
            pending.set_exception(body)
        elif isinstance(body, ConfigError):
            pending.set_exception(body)  # carpool serve names the key and exits 2
        else:
            pending.set_exception(
                RuntimeError(
                    f"model {self._name!r}, replica {self.replica_id}: building the model "
                    f"in its process failed: {body}"
                )
            )

    def _on_exit(self) -> None:
        """The child's sentinel fired (or its pipe closed): it died. Fail what it ran and
        start it again."""
        process = self._process
        if process is None or self._state in (ChildState.DEAD, ChildState.CLOSED):
            return
        self._read_replies()  # answers it sent before it died still count
        process.join(timeout=1.0)
        exitcode = process.exitcode
        starting = self._state is ChildState.STARTING
        self._detach()
        self._state = ChildState.DEAD
        pending, self._pending = self._pending, None
        if pending is not None and not pending.done():
            pending.set_exception(ReplicaDied(self._name, self.replica_id, exitcode))
        if starting:
            return  # _spawn's caller handles it
        log.error(
            "model %r, replica %d: its process %s ended (exit code %s); starting it again",
            self._name,
            self.replica_id,
            process.pid,
            exitcode,
        )
        if self._restarter is None or self._restarter.done():
            assert self._loop is not None
            self._restarter = self._loop.create_task(self._restart())

    async def _restart(self) -> None:
        while self._state is ChildState.DEAD:
            await asyncio.sleep(self._restart_wait_s)
            self._restart_wait_s = min(2 * self._restart_wait_s, RESTART_WAIT_MAX_S)
            if self._state is not ChildState.DEAD:
                return
            try:
                await self._spawn()
            except Exception:
                log.exception(
                    "model %r, replica %d: starting its process again failed; trying again",
                    self._name,
                    self.replica_id,
                )
                continue
            # Counted once it is up (a start that failed restarted nothing), and the wait
            # doubles only while starts keep failing: the next death waits the least again.
            self.counters.num_restarts += 1
            self._restart_wait_s = RESTART_WAIT_S

    def _detach(self) -> None:
        """Stop watching the child and close this side of its pipe."""
        loop, conn, process = self._loop, self._conn, self._process
        if loop is not None and not loop.is_closed():
            if conn is not None:
                loop.remove_reader(conn.fileno())
            if process is not None:
                loop.remove_reader(process.sentinel)
        if conn is not None:
            conn.close()
        self._conn = None
        self._reader.unlink()  # the child's output region, if it could not unlink it

    def _discard(self) -> None:
        """Kill the child (a failed start, a hang, a stop) and forget it."""
        process = self._process
        if process is not None and process.is_alive():
            process.kill()
            process.join(timeout=1.0)
        self._detach()
        if self._state is not ChildState.CLOSED:
            self._state = ChildState.DEAD

    async def _run_here(self, call: ModelCall) -> RunOutput:
        async with self._lock:
            if self._state is not ChildState.READY or self._conn is None:
                raise ReplicaDied(self._name, self.replica_id, self._exitcode())
            now = self._now
            started = now()
            call.check_turn(started)
            header = self._region.write(call.collate())
            assert self._loop is not None
            pending = self._pending = self._loop.create_future()
            with contextlib.suppress(OSError):  # it died: its sentinel fails ``pending``
                self._conn.send(header)
            outputs = await self._within_timeout(pending, started)  # _deliver read them
            self._restart_wait_s = RESTART_WAIT_S
            return call.output(outputs, started, now())

    def _exitcode(self) -> int | None:
        process = self._process
        return None if process is None else process.exitcode

    def _hung(self, started_s: float, timeout_s: float) -> None:
        """Kill the process now and restart it: the next batch must not reach it."""
        process = self._process
        log.error(
            "model %r, replica %d: a batch has run %.3g s, past batch_timeout_s=%s; its "
            "requests fail with BatchTimeout, and its process %s is killed and started again",
            self._name,
            self.replica_id,
            self._now() - started_s,
            timeout_s,
            None if process is None else process.pid,
        )
        if process is not None and process.is_alive():
            process.kill()
            process.join(timeout=1.0)
        self._on_exit()

    def give_up(self) -> None:
        """Closing without waiting: kill the process now (and stop restarting it)."""
        self._close(wait_s=0.0)

    def close(self) -> None:
        """End the process: ask it to stop, kill it if it has not after STOP_WAIT_S."""
        self._close(wait_s=STOP_WAIT_S)

    def _close(self, wait_s: float) -> None:
        if self._state is ChildState.CLOSED:
            return
        self._state = ChildState.CLOSED
        loop = self._loop
        is_loop_open = loop is not None and not loop.is_closed()
        if self._restarter is not None and is_loop_open:
            self._restarter.cancel()
        conn, process = self._conn, self._process
        if wait_s > 0 and conn is not None and process is not None and process.is_alive():
            with contextlib.suppress(OSError):
                conn.send(None)
            process.join(timeout=wait_s)
        self._discard()
        pending, self._pending = self._pending, None
        if pending is not None and not pending.done() and is_loop_open:
            pending.set_exception(ReplicaDied(self._name, self.replica_id, self._exitcode()))
        self._region.close()


def process_replicas(
    name: str,
    devices: Sequence[str],
    source: ModelSource,
    now: Callable[[], float],
    watchdog: Watchdog | None,
    replica_cpus: list[list[int]] | None,
) -> list[ProcessReplica]:
    """One process replica per device, each knowing its siblings."""
    group: list[ProcessReplica] = []
    for i, device in enumerate(devices):
        cpus = replica_cpus[i] if replica_cpus is not None else None
        group.append(ProcessReplica(i, device, name, source, now, watchdog, cpus, group))
    return group
