"""Helpers shared by the performance benchmarks (vs_trl.py, limits.py, overhead.py).

Not a library: measurement plumbing only. Importing this module puts the repository root first on
``sys.path`` and applies :func:`trajflow.infra.env.configure_environment` (before Prefect, Ray or MLflow are
imported), so every script runs standalone as ``.venv/bin/python benchmarks/<name>.py``.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trajflow.infra.env import configure_environment  # noqa: E402

configure_environment()

GIB = 2**30


# --------------------------------------------------------------------------------------------- output


def verdict(name: str, value: float, target: float, *, higher_is_better: bool = True, fmt: str = "{:.3f}") -> bool:
    """Print one ``PASS``/``MISS`` line for a target and return whether it passed."""
    ok = value >= target if higher_is_better else value <= target
    op = ">=" if higher_is_better else "<="
    print(f"{'PASS' if ok else 'MISS'}  {name}: {fmt.format(value)} (target {op} {fmt.format(target)})", flush=True)
    return ok


def header(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


# --------------------------------------------------------------------------------------------- scratch


def scratch_dir(prefix: str, keep: bool = False) -> Path:
    """A new directory under the system temp dir for one benchmark run, removed when the script exits
    unless ``keep`` (a default-recipe run leaves ~2.2 GB there: its checkpoint and final model)."""
    import atexit
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix=prefix))
    if not keep:
        atexit.register(shutil.rmtree, root, True)
    return root


# --------------------------------------------------------------------------------------------- memory


def _tree_processes() -> list[Any]:
    """This process and all its descendants (Ray's GCS, raylet and workers, Prefect's server)."""
    import psutil

    me = psutil.Process()
    procs = [me]
    try:
        procs += me.children(recursive=True)
    except psutil.Error:
        pass
    return procs


#: Ray's and Prefect's side processes, by a piece of their command line -> the name printed.
_SIDE_PROCESSES = (
    ("gcs_server", "Ray GCS"),
    ("raylet/raylet", "Ray raylet"),
    ("dashboard/dashboard.py", "Ray API server (dashboard head)"),
    ("ray::DashboardAgent", "Ray dashboard agent"),
    ("dashboard/agent.py", "Ray dashboard agent"),
    ("ray::RuntimeEnvAgent", "Ray runtime-env agent"),
    ("runtime_env/agent/main.py", "Ray runtime-env agent"),
    ("autoscaler/_private/monitor.py", "Ray autoscaler monitor"),
    ("_private/log_monitor.py", "Ray log monitor"),
    ("trajflow.infra.raywatch", "trajflow Ray watcher"),
    ("prefect.server", "Prefect temporary server"),
)


def process_role(cmdline: list[str], is_driver: bool = False) -> str:
    """What a process of a trajflow run is, from its command line: ``driver``, a Ray actor by its class
    (``ray::PolicyWorker``), a Ray task worker by the task it runs, ``ray::IDLE``, Ray's and Prefect's
    side processes by name (:data:`_SIDE_PROCESSES`), else the command itself."""
    if is_driver:
        return "driver"
    line = " ".join(cmdline)
    for key, name in _SIDE_PROCESSES:
        if key in line:
            return name
    if line.startswith("ray::"):
        return line.split()[0].split(".")[0]  # ray::PolicyWorker.update_actor -> ray::PolicyWorker
    return line[:70]


class RssSampler:
    """Peak total memory of this process tree, sampled in a background thread, and what each process held.

    ``peak_rss`` is the largest sum of RSS over all processes of the tree at one sampling instant
    (shared pages, e.g. Ray's object store or the torch libraries, are counted once per process,
    so this overstates the machine's use a little). A child caught between ``fork`` and ``exec`` (its
    command line still its parent's) shares every page with its parent and is left out of the sum.
    Every ``pss_every``-th sample also sums PSS (proportional set size, shared pages split between
    their users; reading it costs more).

    Each process gets a role (:func:`process_role`): this process is the ``driver``; a Ray worker is
    named by the actor class or the task functions it ran (an idle worker keeps the names of what it ran).

    Args:
        interval_s: seconds between samples.
        pss_every: take a PSS sample every this many samples (0 = never).
    """

    def __init__(self, interval_s: float = 0.25, pss_every: int = 8) -> None:
        self.interval_s = interval_s
        self.pss_every = pss_every
        self.peak_rss = 0
        self.peak_pss = 0
        self.peak_procs: list[tuple[int, int]] = []  # (pid, rss) at the instant of the peak sum
        self.own_peak: dict[int, int] = {}  # pid -> its largest RSS over the run
        self.samples = 0
        self._roles: dict[int, list[str]] = {}  # pid -> roles seen, first first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def role(self, pid: int) -> str:
        """The name of process ``pid``: its role, plus what an idle Ray worker ran before."""
        seen = self._roles.get(pid, ["?"])
        # A Ray worker starts as `python default_worker.py ...` and names itself ray::... once it runs.
        busy = [r for r in seen if r.startswith("ray::") and r != "ray::IDLE"] or \
            [r for r in seen if not r.startswith("ray::") and "default_worker.py" not in r
             and "setup_worker.py" not in r]
        if not busy:
            return "ray::IDLE" if "ray::IDLE" in seen else seen[0]
        if busy[0].startswith("ray::") and busy[0][5:6].isupper():  # an actor: its class says it all
            return busy[0]
        if busy[0].startswith("ray::"):
            return "Ray task worker (" + ", ".join(r[5:] for r in busy) + ")"
        return busy[0]

    def _sample(self) -> None:
        import psutil

        me = os.getpid()
        procs = _tree_processes()
        cmdlines: dict[int, list[str]] = {}
        for p in procs:
            try:
                cmdlines[p.pid] = p.cmdline()
            except psutil.Error:
                pass
        total, rows = 0, []
        pss_total = 0
        want_pss = self.pss_every and self.samples % self.pss_every == 0
        for p in procs:
            try:
                cmd = cmdlines.get(p.pid)
                if not cmd:
                    continue
                if p.pid != me and cmdlines.get(p.ppid()) == cmd:
                    continue  # between fork and exec: its pages are its parent's
                rss = p.memory_info().rss
                role = process_role(cmd, p.pid == me)
                seen = self._roles.setdefault(p.pid, [])
                if role not in seen:
                    seen.append(role)
                total += rss
                rows.append((p.pid, rss))
                self.own_peak[p.pid] = max(self.own_peak.get(p.pid, 0), rss)
                if want_pss:
                    pss_total += p.memory_full_info().pss
            except psutil.Error:  # exited between listing and reading
                continue
        self.samples += 1
        if total > self.peak_rss:
            self.peak_rss = total
            self.peak_procs = sorted(rows, key=lambda r: -r[1])
        if want_pss:
            self.peak_pss = max(self.peak_pss, pss_total)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, top: int | None = None) -> None:
        """Print the peak sum, then every process at that instant (name, GiB, and its own peak over the
        run), then the processes that had ended before it with their own peaks."""
        print(f"peak RSS, all processes (sum at one instant, {self.samples} samples): {self.peak_rss / GIB:.2f} GiB"
              + (f"; peak PSS {self.peak_pss / GIB:.2f} GiB" if self.peak_pss else ""))
        print(f"    {'at the peak':>11s} {'own peak':>9s}  process")
        shown = set()
        for pid, rss in self.peak_procs[:top]:
            shown.add(pid)
            print(f"    {rss / GIB:7.2f} GiB {self.own_peak.get(pid, rss) / GIB:5.2f} GiB  {self.role(pid)} [{pid}]")
        gone = sorted(((p, r) for p, r in self.own_peak.items() if p not in shown), key=lambda kv: -kv[1])
        for pid, rss in gone[:top]:
            print(f"    {'-':>7s}     {rss / GIB:5.2f} GiB  {self.role(pid)} [{pid}] (not running at the peak)")


# --------------------------------------------------------------------------------------------- trajflow runs


@dataclass
class TrajflowRun:
    """What :func:`run_trajflow` measured.

    Attributes:
        summary: ``train()``'s return value.
        metrics: MLflow metric histories, ``name -> [value of iteration 1, 2, ...]``.
        cycle_s: wall seconds of each complete iteration cycle, iteration ``i`` at index ``i - 1``
            (``nan`` for the first): from the end of iteration ``i - 1``'s bookkeeping to the end of
            iteration ``i``'s, i.e. everything the driver does per iteration, including MLflow
            logging and sample tables, but excluding checkpoint saves (timed separately).
        save_s: seconds spent in checkpoint saves, per iteration that saved.
        wall_s: the whole ``train()`` call, start-up included.
        root: the store root (MLflow SQLite lives in it).
        cfg: the resolved config.
    """

    summary: dict
    metrics: dict[str, list[float]]
    cycle_s: list[float]
    save_s: dict[int, float]
    wall_s: float
    root: Path
    cfg: Any
    extra: dict = field(default_factory=dict)

    def warm(self, name: str, skip: int = 1) -> list[float]:
        return self.metrics.get(name, [])[skip:]


def run_trajflow(overrides: Sequence[str], root: Path) -> TrajflowRun:
    """Run the real ``train`` flow in this process and collect per-iteration timings.

    The flow is not changed: ``trajflow.run.log_iteration`` and ``trajflow.run.save`` are wrapped
    (attributes of the package the flow calls ``run.<verb>`` on, looked up at call time) to record when each
    iteration's bookkeeping ends and how long checkpoint saves take.

    Args:
        overrides: ``key=value`` config overrides (``store.root`` is added).
        root: empty directory for the run store and MLflow's SQLite file.

    Returns:
        :class:`TrajflowRun`.
    """
    from mlflow.tracking import MlflowClient

    import trajflow.flows.train as ftrain
    from trajflow import run as session
    from trajflow.config import load_config

    overrides = [f"store.root={root}", *overrides]
    cfg = load_config(None, overrides)
    ends: dict[int, float] = {}
    saves: dict[int, float] = {}
    orig_finish, orig_save = session.log_iteration, session.save

    def timed_save(ctx, iteration, *args, **kwargs):  # the overlapped schedule also passes sampler_state
        t = time.perf_counter()
        try:
            return orig_save(ctx, iteration, *args, **kwargs)
        finally:
            saves[iteration] = saves.get(iteration, 0.0) + time.perf_counter() - t

    def timed_finish(ctx, iteration, metrics):
        out = orig_finish(ctx, iteration, metrics)
        ends[iteration] = time.perf_counter()
        return out

    session.log_iteration, session.save = timed_finish, timed_save
    t0 = time.perf_counter()
    try:
        summary = ftrain.train(None, overrides)
    finally:
        session.log_iteration, session.save = orig_finish, orig_save
    wall = time.perf_counter() - t0
    n = int(cfg.trainer.total_iterations)
    cycle = [float("nan")]
    for it in range(2, n + 1):
        if it in ends and it - 1 in ends:
            cycle.append(ends[it] - ends[it - 1] - saves.get(it - 1, 0.0))  # the save follows the log
        else:
            cycle.append(float("nan"))
    client = MlflowClient(tracking_uri=f"sqlite:///{Path(root).resolve() / 'mlflow.db'}")
    rid = summary["mlflow_run_id"]
    metrics: dict[str, list[float]] = {}
    for key in client.get_run(rid).data.metrics:
        hist = sorted(client.get_metric_history(rid, key), key=lambda m: m.step)
        by_step = {m.step: m.value for m in hist}
        metrics[key] = [by_step.get(i, float("nan")) for i in range(1, n + 1)]
    return TrajflowRun(summary, metrics, cycle, saves, wall, Path(root), cfg)


def load_default_model(dtype: str = "float32"):
    """(model, tokenizer, path) of the default recipe's model, loaded the way the policy worker loads it."""
    from trajflow.config import load_config
    from trajflow.models import load_causal_lm, load_tokenizer, resolve_model_path

    cfg = load_config(None, [])
    path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    model = load_causal_lm(path, dtype, "cpu", cfg.model.attn_implementation)
    return model, load_tokenizer(path), path


def policy_worker(cfg):
    """A local (in-process) :class:`~trajflow.workers.policy.PolicyWorker` on the recipe's model, as the
    train flow builds it: actor, model and rollout sections, the trainer's seed and thread count."""
    from omegaconf import OmegaConf

    from trajflow.models import resolve_model_path
    from trajflow.workers.policy import PolicyWorker

    section = lambda sec: OmegaConf.to_object(cfg[sec])  # noqa: E731
    path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    return PolicyWorker(str(path), section("actor"), section("model"), section("rollout"), int(cfg.trainer.seed),
                        "cpu", int(cfg.trainer.num_threads))


def first_batch_prompts(cfg, worker, batch_size: int | None = None):
    """The recipe's first training batch (``PromptSampler`` at the trainer's seed, ``batch_size`` prompts,
    default ``data.train_batch_size``) and its prompt token ids from ``worker``."""
    from trajflow.prompts import PromptSampler, load_prompt_dataset

    ds = load_prompt_dataset(cfg.data.dataset)
    prompts = PromptSampler(ds.train, batch_size or cfg.data.train_batch_size, cfg.trainer.seed).next_batch()
    return prompts, worker.tokenize_prompts([p.messages for p in prompts], cfg.data.max_prompt_length)


def preload_allocator(setting: str = "auto") -> str:
    """Run this script under the allocator trajflow preloads into its Ray workers.

    The model workers run with ``resources.allocator`` (``trajflow.infra.allocator``: tcmalloc when the
    system has it); a benchmark that computes in its own process (limits.py in-process, TRL in
    vs_trl.py) re-executes itself once with the same ``LD_PRELOAD``, so both sides of a comparison
    and the in-process measurements see the allocator the pipeline uses. Returns what is loaded.
    """
    from trajflow.infra.allocator import loaded_allocator, worker_env_vars

    env = worker_env_vars(setting)
    if env and loaded_allocator() is None and not os.environ.get("TRAJFLOW_BENCH_REEXEC"):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env, "TRAJFLOW_BENCH_REEXEC": "1"})
    return loaded_allocator() or "system (glibc malloc)"


def set_all_threads() -> int:
    """Use every CPU for torch (what the policy worker does with ``trainer.num_threads=0``)."""
    import torch

    n = os.cpu_count() or 1
    torch.set_num_threads(n)
    return n
