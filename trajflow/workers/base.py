"""What every model worker does the same way: device check, torch threads, seeds, identity queries.

The policy, rollout, reference, critic and reward-model workers inherit :class:`Worker` and call
:meth:`Worker._start` first thing in their constructor.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from trajflow.workers.group import dispatch


def set_threads(num_threads: int) -> int:
    """Use ``num_threads`` torch threads (0: every CPU of the machine).

    Ray sets ``OMP_NUM_THREADS`` to an actor's ``num_cpus`` (often 1), which would leave a CPU
    worker using one core.
    """
    n = num_threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def seed_all(seed: int) -> None:
    """Seed torch's, numpy's and Python's global RNGs (numpy's takes the seed modulo 2**32)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


class Worker:
    """A model worker's plumbing, run as a Ray actor (or a rank of a
    :class:`~trajflow.workers.group.WorkerGroup`).

    Attributes:
        device: the torch device (``trainer.device``).
        threads: the torch threads this process uses.
    """

    device: str = "cpu"
    threads: int = 0

    def _start(self, device: str, num_threads: int, seed: int | None = None) -> None:
        """Check ``device`` on this node, set the torch threads and (given a ``seed``) seed every RNG.

        Raises:
            trajflow.errors.DeviceError: ``device`` is not usable on this Ray worker's node.
        """
        from trajflow.infra.devices import require_device

        require_device(device, "this Ray worker's node")
        self.device = device
        self.threads = set_threads(num_threads)
        if seed is not None:
            seed_all(seed)

    @dispatch("rank0")
    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    @dispatch("rank0")
    def pid(self) -> int:
        """This worker's process id (a cheap call that answers once the constructor is done)."""
        return os.getpid()

    @dispatch("rank0")
    def info(self) -> dict:
        """``pid`` and torch ``threads``; workers add their own entries."""
        return {"pid": os.getpid(), "threads": self.threads}
