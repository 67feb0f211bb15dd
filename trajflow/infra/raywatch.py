"""Reap what a driver started (its local Ray cluster, Prefect's temporary server) when it dies.

:func:`start` launches this module as a watcher process in its own session; the driver sends it the
``(pid, create_time)`` of the processes it started (Ray's, and the temporary Prefect API server)
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
# psutil's create_time() is start ticks + /proc/stat's btime, a whole second that can read one apart
# in two processes (or two calls) when the clock is adjusted; the driver records create times and the
# watcher compares them, so "same process" means within this much (a pid reused within a second of
# its previous owner's start is not a case worth guarding against).
CTIME_TOL_S = 1.5


def descendants() -> set[tuple[int, float]]:
    """``(pid, create_time)`` of every live descendant of this process."""
    import psutil

    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            out.add((p.pid, p.create_time()))
        except psutil.Error:
            pass
    return out


#: The module that runs Prefect 3's temporary API server: without ``PREFECT_API_URL`` the first flow
#: of a process starts ``python -m uvicorn --factory prefect.server.api.server:create_app`` as its
#: child, stopped only by an ``atexit`` hook that a SIGKILLed driver never runs.
PREFECT_SERVER_APP = "prefect.server.api.server:create_app"


def ray_processes(candidates: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    """The candidates that are Ray's (their command line names Ray: ``gcs_server``, ``raylet``, ``ray::...``).

    Watchers (this module's own processes, whose command line names ``raywatch``) are never
    candidates: a watcher listed in its own kill list would terminate itself before the others.
    """
    import psutil

    out = []
    for pid, ctime in candidates:
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        if "ray" in cmd and "raywatch" not in cmd:
            out.append((pid, ctime))
    return sorted(out)


def prefect_servers(candidates: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    """The candidates that are a temporary Prefect API server (see :data:`PREFECT_SERVER_APP`)."""
    import psutil

    out = []
    for pid, ctime in candidates:
        try:
            if PREFECT_SERVER_APP in psutil.Process(pid).cmdline():
                out.append((pid, ctime))
        except psutil.Error:
            continue
    return sorted(out)


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
    """``(pid, create_time)`` of processes started by one of ``raylets`` (``RAY_RAYLET_PID`` in their
    environment) that were created after that raylet and before ``before`` (a time.time())."""
    import psutil

    started = dict(raylets)
    out = []
    if not started:
        return out
    for p in psutil.process_iter():
        try:
            owner = int(p.environ().get("RAY_RAYLET_PID", "0"))
            ct = p.create_time()
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

    died_at = time.time()
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
            if pid != os.getpid() and abs(p.create_time() - ctime) < CTIME_TOL_S \
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
    """``(pid, create_time)`` of every live descendant of the ``parents`` that still run with their
    recorded create time (a parent whose pid was reused contributes nothing)."""
    import psutil

    out = set()
    for pid, ctime in parents:
        try:
            parent = psutil.Process(pid)
            if abs(parent.create_time() - ctime) >= CTIME_TOL_S:
                continue
            kids = parent.children(recursive=True)
        except psutil.Error:
            continue
        for p in kids:
            try:
                out.add((p.pid, p.create_time()))
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
