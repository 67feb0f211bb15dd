"""Worker groups: N identical Ray actors of one role over a resource pool, called like one actor.

A worker method declares with :func:`dispatch` how it runs on a :class:`WorkerGroup`: ``split``
(row arguments cut across ranks, results gathered in row order), ``broadcast`` (the default),
``gather`` or ``rank0``; the class docstring describes each mode.
"""

from __future__ import annotations

import dataclasses
import inspect
import socket
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from trajflow.modeling.packing import balanced_partition

__all__ = ["MODES", "DispatchSpec", "WorkerGroup", "balanced_partition", "dispatch", "dispatch_spec", "free_address",
           "kill_workers", "merge_split", "plan_split"]

MODES = ("split", "broadcast", "gather", "rank0")


@dataclass(frozen=True)
class DispatchSpec:
    """How a worker method is dispatched over a group.

    Attributes:
        mode: one of :data:`MODES`.
        split_args: names of the row arguments cut across ranks in ``split`` mode (all of equal
            length); the first one's rows also weigh the balancing together with the others.
    """

    mode: str = "broadcast"
    split_args: tuple[str, ...] = ()


def dispatch(mode: str, split_args: Sequence[str] = ()) -> Callable[[Callable], Callable]:
    """Declare how a worker method runs on a :class:`WorkerGroup` (see the modes there).

    Raises:
        ValueError: unknown mode, or ``split`` without row arguments.
    """
    if mode not in MODES:
        raise ValueError(f"dispatch mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "split" and not split_args:
        raise ValueError("dispatch('split') needs split_args: the names of the per-row arguments")

    def deco(fn: Callable) -> Callable:
        fn._trajflow_dispatch = DispatchSpec(mode, tuple(split_args))  # type: ignore[attr-defined]
        return fn

    return deco


def dispatch_spec(cls: type, method: str) -> DispatchSpec:
    fn = getattr(cls, method, None)
    if fn is None:
        raise AttributeError(f"{cls.__name__} has no method {method!r}")
    return getattr(fn, "_trajflow_dispatch", DispatchSpec())


# --------------------------------------------------------------------------------------------
# splitting rows


def _row_weight(values: Sequence[Any]) -> float:
    w = 0.0
    for v in values:
        w += float(len(v)) if hasattr(v, "__len__") and not isinstance(v, (str, bytes)) else 1.0
    return w


def plan_split(bound: dict[str, Any], split_args: Sequence[str], k: int,
               pad: bool) -> tuple[list[list[int]], list[int]]:
    """Rows per rank for a ``split`` call: (row indices per rank, padding rows added per rank).

    Raises:
        ValueError: the row arguments have different lengths.
    """
    lengths = {name: len(bound[name]) for name in split_args}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"split arguments must have one entry per row, got lengths {lengths}")
    n = next(iter(lengths.values()))
    weights = [_row_weight([bound[name][i] for name in split_args]) for i in range(n)]
    parts = balanced_partition(weights, k, equal_size=True)
    width = max(len(p) for p in parts) if parts else 0
    pads = [width - len(p) if pad and n else 0 for p in parts]
    return parts, pads


def _take(seq: Any, idx: list[int]) -> list:
    return [seq[i] for i in idx]


def merge_split(results: Sequence[Any], parts: Sequence[list[int]], pads: Sequence[int], n: int) -> Any:
    """Put per-rank results of a ``split`` call back into the original row order.

    A list result (or a dict's or frozen dataclass's list value, e.g. the fields of
    :class:`trajflow.stages.rollout.Generation`) with ``b`` entries per input row on every rank is
    reassembled row by row (``b`` = e.g. ``rollout.n`` samples per prompt); padding rows are
    dropped. Other values come from rank 0 (a ``Generation``'s ``policy_version``: the ranks
    hold the same weights), except timings: ``timing_s/*`` entries of a dict, or of a dataclass's
    dict field (``Generation.timing``), are the maximum over ranks (the slowest rank is what the
    call waited for).
    """
    def rows_per_input(value: Any, rank: int) -> int | None:
        m = len(parts[rank]) + pads[rank]
        if not isinstance(value, (list, tuple)) or m == 0 or len(value) % m:
            return None
        return len(value) // m

    def merge_lists(values: Sequence[Any]) -> list | None:
        blocks = {rows_per_input(v, r) for r, v in enumerate(values) if len(parts[r]) + pads[r]}
        if len(blocks) != 1 or None in blocks:
            return None
        b = blocks.pop()
        out: list = [None] * (n * b)
        for r, v in enumerate(values):
            for j, row in enumerate(parts[r]):
                out[row * b:(row + 1) * b] = list(v[j * b:(j + 1) * b])
        return out

    def merge_dicts(dicts: Sequence[dict]) -> dict:
        merged: dict = {}
        for key in dicts[0]:
            values = [d[key] for d in dicts]
            lst = merge_lists(values) if isinstance(dicts[0][key], (list, tuple)) else None
            if lst is not None:
                merged[key] = lst
            elif key.startswith("timing_s/") and all(isinstance(v, (int, float)) for v in values):
                merged[key] = max(values)
            else:
                merged[key] = dicts[0][key]
        return merged

    first = results[0]
    if isinstance(first, dict):
        return merge_dicts(results)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = {}
        for f in dataclasses.fields(first):
            values = [getattr(res, f.name) for res in results]
            if isinstance(values[0], dict):
                fields[f.name] = merge_dicts(values)
            elif isinstance(values[0], (list, tuple)):
                lst = merge_lists(values)
                if lst is None:
                    raise ValueError(f"split results' {type(first).__name__}.{f.name} must have a fixed number of "
                                     "entries per row on every rank")
                fields[f.name] = lst
            else:
                fields[f.name] = values[0]
        return dataclasses.replace(first, **fields)
    lst = merge_lists(results)
    if lst is None:
        raise ValueError("split results must be lists (or dicts of lists) with a fixed number of entries per row")
    return lst


def _combine(mode: str, parts: Any, pads: Any, n: int, *results: Any) -> Any:
    if mode == "split":
        return merge_split(results, parts, pads, n)
    if mode == "gather":
        return list(results)
    return results[0]


_REMOTE_COMBINE: Any = None


def _remote_combine() -> Any:
    """``_combine`` as a zero-CPU Ray task (Ray resolves the ranks' result refs before it runs)."""
    global _REMOTE_COMBINE
    if _REMOTE_COMBINE is None:
        import ray

        _REMOTE_COMBINE = ray.remote(num_cpus=0)(_combine)
    return _REMOTE_COMBINE


# --------------------------------------------------------------------------------------------
# the group


def free_address() -> tuple[str, int]:
    """This node's IP (as Ray sees it) and a free TCP port: the rendezvous of a process group."""
    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ip, port


def _shipped(value: Any) -> Any:
    """``value`` in the object store: itself when it is an ``ObjectRef`` already (``ray.put`` refuses one)."""
    import ray

    return value if isinstance(value, ray.ObjectRef) else ray.put(value)


class _Method:
    def __init__(self, group: "WorkerGroup", name: str) -> None:
        self.group, self.name = group, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.group.submit(self.name, *args, **kwargs)


class WorkerGroup:
    """The ranks of one role (the policy's data-parallel ranks, the reference's replicas, rollout
    engines), dispatched by mode:

    - ``split``: the row arguments (lists with one entry per row) are cut across ranks, balanced by
      token count (:func:`balanced_partition`), each rank computes its rows, and the results are
      gathered back **in the original row order** (:func:`merge_split`);
    - ``broadcast``: every rank gets the same arguments; rank 0's result is returned (used for
      state-changing calls that all ranks must make, e.g. ``update_actor``, ``save_checkpoint``);
    - ``gather``: every rank gets the same arguments; the list of per-rank results is returned;
    - ``rank0``: only rank 0 runs it (cheap queries: ``info``, ``tokenize_prompts``).

    Undecorated methods are ``broadcast`` (safe: ranks never drift apart). The group quacks like a
    Ray actor handle: ``group.method.remote(*args)`` returns one ``ObjectRef`` (for one rank it *is*
    the actor's own call, so a single-actor run behaves and costs exactly as before; for several
    ranks a zero-CPU Ray task combines the ranks' results), which keeps
    ``ray.get(ctx.actor.update_actor.remote(...))`` in the flow's tasks unchanged.
    :meth:`execute` is the synchronous form.

    Args:
        handles: the Ray actor handles, rank order.
        worker_cls: the (undecorated) worker class, for dispatch modes and signatures.
        role: the role name (messages, metrics).
        lockstep: pad ``split`` calls so every rank gets the same number of rows (ranks whose
            forward passes are collectives, e.g. DeepSpeed ZeRO-3, must run equally many).
    """

    def __init__(self, handles: Sequence[Any], worker_cls: type, role: str, lockstep: bool = False) -> None:
        if not handles:
            raise ValueError(f"worker group {role!r} needs at least one actor")
        self.handles = list(handles)
        self.worker_cls = worker_cls
        self.role = role
        self.lockstep = lockstep

    @classmethod
    def spawn(cls, worker_cls: type, args: Sequence[Any], options: Sequence[dict], role: str,
              kwargs: dict | None = None, lockstep: bool = False, max_restarts: int = 0) -> "WorkerGroup":
        """Start one actor per entry of ``options`` (Ray ``.options()`` per rank) with the same arguments."""
        import ray

        remote_cls = ray.remote(max_restarts=max_restarts)(worker_cls)
        handles = [remote_cls.options(**opt).remote(*args, **(kwargs or {})) for opt in options]
        return cls(handles, worker_cls, role, lockstep)

    @property
    def world_size(self) -> int:
        return len(self.handles)

    def __len__(self) -> int:
        return len(self.handles)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_") or name in ("handles", "worker_cls", "role", "lockstep"):
            raise AttributeError(name)
        dispatch_spec(self.worker_cls, name)  # AttributeError for unknown methods
        return _Method(self, name)

    # ---------------------------------------------------------------- calls
    def submit(self, method: str, *args: Any, mode: str | None = None, **kwargs: Any) -> Any:
        """Dispatch ``method`` and return one ``ObjectRef`` of the combined result."""
        import ray

        spec = dispatch_spec(self.worker_cls, method)
        mode = mode or spec.mode
        if mode not in MODES:
            raise ValueError(f"dispatch mode {mode!r} is not one of {', '.join(MODES)}")
        if len(self.handles) == 1 or mode == "rank0":
            return getattr(self.handles[0], method).remote(*args, **kwargs)
        if mode == "split":
            sig = inspect.signature(getattr(self.worker_cls, method))
            bound = sig.bind(None, *args, **kwargs)
            bound.apply_defaults()
            values = {k: v for k, v in bound.arguments.items() if not k.startswith("_ray")}  # Ray's tracing arg
            values.pop(next(iter(sig.parameters)))  # self
            names = spec.split_args
            n = len(values[names[0]])
            parts, pads = plan_split(values, names, len(self.handles), self.lockstep)
            refs = []
            for r, handle in enumerate(self.handles):
                idx = parts[r] + ([parts[r][-1] if parts[r] else 0] * pads[r])
                call = {k: (_take(v, idx) if k in names else v) for k, v in values.items()}
                refs.append(getattr(handle, method).remote(**call))
            return _remote_combine().remote("split", parts, pads, n, *refs)
        # broadcast / gather: ship the arguments once, not once per rank (an ObjectRef is shipped already)
        args_refs = [_shipped(a) for a in args]
        kw_refs = {k: _shipped(v) for k, v in kwargs.items()}
        refs = [getattr(h, method).remote(*args_refs, **kw_refs) for h in self.handles]
        return _remote_combine().remote(mode, None, None, 0, *refs)

    def execute(self, method: str, *args: Any, mode: str | None = None, **kwargs: Any) -> Any:
        """Run ``method`` on the group and wait: ``split`` / ``broadcast`` / ``gather`` / ``rank0``."""
        import ray

        return ray.get(self.submit(method, *args, mode=mode, **kwargs))

    def init_distributed(self, timeout_s: float = 600.0) -> list:
        """Rendezvous the ranks into one torch.distributed process group (rank 0's node hosts it).

        Calls ``rendezvous_address()`` on rank 0, then ``init_distributed(addr, port, rank,
        world_size)`` on every rank at once (the process group forms only when all have joined).

        Returns:
            Each rank's ``init_distributed`` result.
        """
        import ray

        addr, port = ray.get(self.handles[0].rendezvous_address.remote(), timeout=timeout_s)
        return ray.get([h.init_distributed.remote(addr, port, r, len(self.handles))
                        for r, h in enumerate(self.handles)], timeout=timeout_s)

    def node_ids(self) -> list[str | None]:
        """The Ray node id of every rank (``None`` for workers without a ``node_id()`` method)."""
        import ray

        if not hasattr(self.worker_cls, "node_id"):
            return [None] * len(self.handles)
        return ray.get([h.node_id.remote() for h in self.handles])

    def kill(self) -> None:
        """Stop every rank (no restart)."""
        import ray

        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # already dead
                pass


def kill_workers(handle: Any) -> None:
    """Stop a worker group or a plain actor handle (``None`` is ignored)."""
    if handle is None:
        return
    if isinstance(handle, WorkerGroup):
        handle.kill()
        return
    import ray

    try:
        ray.kill(handle)
    except Exception:  # already dead
        pass

