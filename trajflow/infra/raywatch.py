"""Reap what a driver started (its local Ray cluster, Prefect's temporary server) when it dies.

:func:`start` launches this module as a watcher process in its own session; the driver sends it the
``(pid, started_at)`` of the processes it started (Ray's, and the temporary Prefect API server)
and keeps the pipe open. When the pipe closes, however the driver exited, the watcher terminates
(then kills) those still running with their recorded create time, their descendants, and the
workers their raylet started later. It imports nothing but the standard library and psutil. Why,
and how it finds the later ones: docs/scaling.md ("The Ray watcher").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

GRACE_S = 1.0
TERM_WAIT_S = 3.0
POLL_S = 2.0
# A process is named by its pid and :func:`started_at` (seconds after boot), never by psutil's
# create_time(): that is start ticks + /proc/stat's btime, and btime moves with the wall clock, so a
# clock step (NTP, a VM resumed from a pause) between the driver's record and the watcher's check made
# a listed process look like a reused pid and escape the reap. started_at reads btime twice within
# microseconds and cancels it; "same process" still allows this much, for a btime read on either side
# of a step (a pid reused within a second of its previous owner's start is not a case worth guarding).
CTIME_TOL_S = 1.5


def started_at(p) -> float:
    """When the ``psutil.Process`` ``p`` started, in seconds after system boot (immune to clock steps).

    Raises:
        psutil.Error: ``p`` is gone or not readable.
    """
    import psutil

    return p.create_time() - psutil.boot_time()


def since_boot() -> float:
    """Now, on the :func:`started_at` scale (seconds after system boot)."""
    import psutil

    return time.time() - psutil.boot_time()


def descendants() -> set[tuple[int, float]]:
    """``(pid, started_at)`` of every live descendant of this process."""
    import psutil

    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            out.add((p.pid, started_at(p)))
        except psutil.Error:
            pass
    return out


#: The module that runs Prefect 3's temporary API server: without ``PREFECT_API_URL`` the first flow
#: of a process starts ``python -m uvicorn --factory prefect.server.api.server:create_app`` as its
#: child, stopped only by an ``atexit`` hook that a SIGKILLed driver never runs.
PREFECT_SERVER_APP = "prefect.server.api.server:create_app"


def command_lines(candidates: Iterable[tuple[int, float]]) -> dict[tuple[int, float], list[str]]:
    """One reading of each candidate's command line; processes gone (or zombies) are left out.

    An empty list is a process caught inside exec(): Popen has returned (exec closed the parent's
    pipe) but the new image's arguments are not mapped yet, so it is too early to judge what it is.
    """
    import psutil

    out = {}
    for pid, ctime in candidates:
        try:
            out[(pid, ctime)] = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
    return out


def is_ray(cmdline: list[str]) -> bool:
    """Whether a command line is Ray's (it names Ray: ``gcs_server``, ``raylet``, ``ray::...``).

    Watchers (this module's own processes, whose command line names ``raywatch``) never are: a
    watcher listed in its own kill list would terminate itself before the others.
    """
    cmd = " ".join(cmdline)
    return "ray" in cmd and "raywatch" not in cmd


def is_prefect_server(cmdline: list[str]) -> bool:
    """Whether a command line is a temporary Prefect API server's (see :data:`PREFECT_SERVER_APP`)."""
    return PREFECT_SERVER_APP in cmdline


class Watcher:
    """Handle on a running watcher process; :meth:`add` more processes, :meth:`close` to reap now."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def add(self, procs: Iterable[tuple[int, float]]) -> None:
        procs = list(procs)
        if not procs or self.proc.stdin is None or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write((json.dumps(procs) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def close(self) -> None:
        """Close the pipe: the watcher reaps whatever of the listed processes is still alive, then exits."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


def start(procs: Iterable[tuple[int, float]]) -> Watcher:
    """Start a watcher for ``procs`` (it outlives this process by design; see the module docstring)."""
    pkg_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([sys.executable, "-m", "trajflow.infra.raywatch", str(os.getpid())], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
                            close_fds=True)
    w = Watcher(proc)
    w.add(procs)
    return w


def raylet_workers(raylets: Iterable[tuple[int, float]], before: float) -> list[tuple[int, float]]:
    """``(pid, started_at)`` of processes started by one of ``raylets`` (``RAY_RAYLET_PID`` in their
    environment) that were created after that raylet and before ``before`` (a :func:`since_boot`)."""
    import psutil

    started = dict(raylets)
    out = []
    if not started:
        return out
    for p in psutil.process_iter():
        try:
            owner = int(p.environ().get("RAY_RAYLET_PID", "0"))
            ct = started_at(p)
        except (psutil.Error, ValueError):
            continue
        if owner in started and started[owner] - CTIME_TOL_S <= ct < before:
            out.append((p.pid, ct))
    return out


def reap(procs: Iterable[tuple[int, float]], grace_s: float = GRACE_S, term_wait_s: float = TERM_WAIT_S,
         raylets: Iterable[tuple[int, float]] = ()) -> list[int]:
    """Terminate (then kill) the listed processes that still run with their recorded create time, and
    the workers of ``raylets`` (see :func:`raylet_workers`).

    Returns:
        The pids signalled.
    """
    import psutil

    died_at = since_boot()
    procs = set(procs)
    # Children the listed processes started since the last poll (Ray's agents a raylet starts late)
    # are looked up now, before the grace period in which a dying raylet can orphan them.
    procs |= children_of(procs)
    time.sleep(grace_s)
    procs |= children_of(procs)
    alive = []
    for pid, ctime in procs | set(raylet_workers(raylets, died_at)):
        try:
            p = psutil.Process(pid)
            if pid != os.getpid() and abs(started_at(p) - ctime) < CTIME_TOL_S \
                    and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            pass
    for p in alive:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(alive, timeout=term_wait_s)
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            pass
    return [p.pid for p in alive]


def children_of(parents: Iterable[tuple[int, float]]) -> set[tuple[int, float]]:
    """``(pid, started_at)`` of every live descendant of the ``parents`` that still run with their
    recorded create time (a parent whose pid was reused contributes nothing)."""
    import psutil

    out = set()
    for pid, ctime in parents:
        try:
            parent = psutil.Process(pid)
            if abs(started_at(parent) - ctime) >= CTIME_TOL_S:
                continue
            kids = parent.children(recursive=True)
        except psutil.Error:
            continue
        for p in kids:
            try:
                out.add((p.pid, started_at(p)))
            except psutil.Error:
                pass
    return out


def main() -> None:
    import select

    import psutil

    procs: set[tuple[int, float]] = set()
    raylets: set[tuple[int, float]] = set()
    fd = sys.stdin.buffer.fileno()
    pending = b""
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # EOF: the driver closed the pipe or died
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                try:
                    new = {(int(pid), float(ct)) for pid, ct in json.loads(line)}
                except (ValueError, TypeError):
                    continue
                procs |= {(pid, ct) for pid, ct in new if pid != os.getpid()}  # never reap itself
                for pid, ct in new:
                    try:
                        if psutil.Process(pid).name() == "raylet":
                            raylets.add((pid, ct))
                    except psutil.Error:
                        pass
        procs |= children_of(raylets)
    reap(sorted(procs), raylets=sorted(raylets))


if __name__ == "__main__":
    main()
