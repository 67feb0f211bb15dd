"""The edges of the Prefect run graph: each stage task run drawn behind the task runs it really waits for.

Prefect infers a task run's upstream from its parameters: an argument whose ``id()`` is that of an
earlier task's result, or of anything one level inside it, becomes an edge. That is not what a run
depends on: results that are plain ``dict`` s, ``str`` s or ints above 256 (a ``StageRef``'s row count,
the values of the gate's or the update's dict) are tracked by ``id()`` alone, so an argument that
reuses the address of a freed result, or an object a result also holds, draws an edge from an
unrelated task, and the graph criss-crosses. :class:`StageGraph` therefore passes every argument
``quote`` d (Prefect does not look inside) and names the upstream task runs itself with ``wait_for``:

- a stage waits for the stages whose outputs it takes (``reward`` for the ``rollout`` it scores,
  ``advantage`` for the rollout, reward and gate, ``update`` for all four): the results of earlier
  calls are recognised by identity, and each is held, so its ``id()`` cannot be reused while the
  flow runs;
- ``rollout`` and ``validate`` also wait for the newest ``update`` (the weights they sample with).

So one iteration reads rollout -> reward -> gate -> advantage -> update, and the next iteration's
rollout hangs off that update.
"""

from __future__ import annotations

from typing import Any

from prefect.utilities.annotations import quote

#: Stage tasks that sample with the policy: they wait for the newest update.
SAMPLING = ("rollout", "validate")


class StageGraph:
    """Upstream task runs of the stage tasks of one flow run (see the module docstring)."""

    def __init__(self) -> None:
        self._runs: dict[int, tuple[Any, Any]] = {}  # id(result) -> (result, its state or future)
        self.last_update: Any = None

    def upstream(self, name: str, args: tuple) -> list:
        """The states/futures of the task runs a call of stage ``name`` with ``args`` waits for."""
        ups = [self._runs[id(a)][1] for a in args if id(a) in self._runs and self._runs[id(a)][0] is a]
        if name in SAMPLING and self.last_update is not None:
            ups.append(self.last_update)
        return ups

    def produced(self, name: str, result: Any, run: Any) -> None:
        """Record that ``run`` (a state or future) returned ``result``."""
        self._runs[id(result)] = (result, run)
        if name == "update":
            self.last_update = run


class LinkedTask:
    """A stage task called with explicit ``wait_for`` edges (:class:`StageGraph`) and quoted arguments;
    called (or submitted) like the task itself, returning its result (a future)."""

    def __init__(self, task: Any, name: str, graph: StageGraph) -> None:
        self.task, self.name, self.graph = task, name, graph

    def __getattr__(self, attr: str) -> Any:
        # The task's own settings (retries, timeout_seconds, task_run_name, ...) read through.
        if attr == "task":
            raise AttributeError(attr)
        return getattr(self.task, attr)

    def with_options(self, **options: Any) -> "LinkedTask":
        return LinkedTask(self.task.with_options(**options), self.name, self.graph)

    def __call__(self, *args: Any) -> Any:
        ups = self.graph.upstream(self.name, args)
        state = self.task(*[quote(a) for a in args], wait_for=ups or None, return_state=True)
        result = state.result()  # the task's own exception (GateFailed, ...) is raised here
        self.graph.produced(self.name, result, state)
        return result

    def submit(self, *args: Any, wait_for: list | None = None) -> "LinkedFuture":
        given = [w.future if isinstance(w, LinkedFuture) else w for w in wait_for or [] if w is not None]
        ups = self.graph.upstream(self.name, args) + given
        future = self.task.submit(*[quote(a) for a in args], wait_for=ups or None)
        return LinkedFuture(future, self.name, self.graph)


class LinkedFuture:
    """A submitted stage task's future whose result, once read, is known to the graph."""

    def __init__(self, future: Any, name: str, graph: StageGraph) -> None:
        self.future, self.name, self.graph = future, name, graph

    @property
    def task_run_id(self):
        return self.future.task_run_id

    def wait(self, timeout: float | None = None) -> None:
        self.future.wait(timeout)

    def result(self) -> Any:
        result = self.future.result()
        self.graph.produced(self.name, result, self.future)
        return result
