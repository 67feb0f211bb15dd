"""Fault injection for crash tests: ``TRAJFLOW_FAULT=<point>:<iteration>[,<point>:<iteration>...]``.

The training code calls :func:`fault_point` at a few named places. When the environment variable
names that point and iteration, the process kills itself with ``SIGKILL`` right there: no
``finally`` blocks, no ``atexit``, no flushing of anything but stdout/stderr, exactly like the OOM
killer or a preempted node. Tests use it to check that ``trajflow resume`` continues such a run bit
for bit.

Points (``<iteration>`` is the training iteration, or ``*`` for any):

========================  ===============================================================
``rollout``               generation submitted to the policy worker, not yet returned
``after_reward``          reward output stored, advantage not started
``weight_sync``           a weight snapshot sent to the rollout workers, not yet loaded there
                          (an overlapped or partial rollout about to generate)
``update``                policy update running on the worker, its result not yet received
``checkpoint``            worker state written into the checkpoint's temp folder, checkpoint
                          not yet complete (no ``trainer_state.json``, not renamed)
``store_write``           a store file's temp copy written and fsynced, not yet renamed
                          (iteration ``*`` only: the store does not know iterations)
========================  ===============================================================

When the variable is unset, :func:`fault_point` is a single ``is None`` test.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "TRAJFLOW_FAULT"
POINTS = ("rollout", "after_reward", "update", "checkpoint", "store_write", "weight_sync")


def parse(spec: str | None) -> frozenset[tuple[str, int | None]] | None:
    """Parse a ``TRAJFLOW_FAULT`` value into ``{(point, iteration or None for '*')}``.

    Raises:
        ValueError: an entry is not ``point:iteration``, names an unknown point, or its iteration is
            neither an integer nor ``*``.
    """
    if not spec or not spec.strip():
        return None
    out = set()
    for entry in spec.split(","):
        point, sep, it = entry.strip().partition(":")
        if not sep or point not in POINTS:
            raise ValueError(f"{ENV}={spec!r}: entry {entry!r} must be <point>:<iteration> with point one of "
                             f"{', '.join(POINTS)}")
        if it == "*":
            out.add((point, None))
        else:
            try:
                out.add((point, int(it)))
            except ValueError:
                raise ValueError(f"{ENV}={spec!r}: iteration {it!r} in {entry!r} is not an integer or '*'") from None
    return frozenset(out)


_SPEC = parse(os.environ.get(ENV))


def fault_point(point: str, iteration: int | None = None) -> None:
    """SIGKILL this process if ``TRAJFLOW_FAULT`` names ``point`` at ``iteration`` (or at ``*``)."""
    if _SPEC is None:
        return
    if (point, iteration) in _SPEC or (point, None) in _SPEC:
        print(f"{ENV}: SIGKILL at {point}:{iteration} (pid {os.getpid()})", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
