"""TensorBoard and Weights & Biases copies of a run's metrics: ``trainer.logger``'s ``tensorboard``
and ``wandb``, as verl names them.

MLflow stays the run's record (resume, compare, evaluate and the dashboard read it); these two are
mirrors of it. Every point :meth:`trajflow.tracking.Tracker.log_metrics` writes to MLflow is
written to each mirror too, under the same (MLflow-valid) name and at the same step, after MLflow
took it. A resumed session gets only the points MLflow did not have yet, so a mirror holds one
value per (name, step) across sessions, the same as the MLflow run.

Where they write (verl's environment variables override the defaults, as in verl):

- TensorBoard: ``<run folder>/tensorboard`` (``TENSORBOARD_DIR`` names the log directory itself),
  with ``torch.utils.tensorboard.SummaryWriter``; one event file per session in the same directory,
  flushed after every step (a killed session loses nothing it logged). TensorBoard stores scalars
  as float32. Validation generations: the text ``val/generations`` (a markdown table), as verl.
- W&B: offline mode unless ``WANDB_MODE`` says otherwise (nothing is sent, nobody logs in; upload
  later with ``wandb sync``), under ``<run folder>/wandb/`` (``WANDB_DIR`` names the directory the
  ``wandb/`` folder goes in); project ``trainer.project_name`` (default ``trajflow-<recipe>``), run
  name ``trainer.experiment_name`` (default: the trajflow run id), config the resolved config,
  validation generations as the table ``val/generations``, as verl. The
  W&B run id is kept in ``run.json`` (``wandb_run_id``) and reused by a resume, so every session is
  the same W&B run (an offline session is one ``offline-run-*`` folder; ``wandb sync`` merges them).
  A session killed with SIGKILL loses what W&B had not flushed to its ``.wandb`` file yet (about
  the last second, and the last step's row).

A run folder is data: ``run.json``'s W&B id is used only as an id (checked against
:data:`WANDB_ID`), and a directory recorded there is never written to: a session writes where its
own environment says, and only notes when that differs from an earlier session's.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)

#: ``trainer.logger`` names this module writes, each with the package it needs.
MIRRORS = {"tensorboard": "tensorboard", "wandb": "wandb"}
INSTALL_HINT = "pip install 'trajflow[loggers]'"
#: What a stored W&B run id may be (W&B's generated ids are 8 of ``[a-z0-9]``).
WANDB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Characters W&B refuses in a project name.
_WANDB_PROJECT_BAD = re.compile(r"[/\\#?%:]")


def logger_names(cfg) -> list[str]:
    """``trainer.logger`` as a list of names (verl accepts one name for a list of one)."""
    value = cfg.trainer.get("logger", ["console", "mlflow"])
    return [value] if isinstance(value, str) else [str(v) for v in value]


def missing_package(name: str) -> str | None:
    """The package logger ``name`` needs when it is not installed, else None (nothing is imported)."""
    pkg = MIRRORS.get(name)
    if pkg is None:
        return None
    try:
        found = importlib.util.find_spec(pkg) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else pkg


def tensorboard_dir(run_dir: Path) -> Path:
    """``TENSORBOARD_DIR`` (verl's variable: the log directory itself), else ``<run_dir>/tensorboard``."""
    env = os.environ.get("TENSORBOARD_DIR")
    return Path(env).expanduser().resolve() if env else Path(run_dir).resolve() / "tensorboard"


def wandb_dir(run_dir: Path) -> Path:
    """The directory W&B makes its ``wandb/`` folder in: ``WANDB_DIR`` (W&B's variable), else the run folder."""
    env = os.environ.get("WANDB_DIR")
    return Path(env).expanduser().resolve() if env else Path(run_dir).resolve()


def stored_wandb_id(meta: Mapping[str, Any], source: str | Path) -> str | None:
    """``run.json``'s ``wandb_run_id``, checked to be only an id.

    Raises:
        trajflow.errors.StoreError: it is not a string matching :data:`WANDB_ID` (names the file).
    """
    from trajflow.errors import StoreError

    value = meta.get("wandb_run_id")
    if value is None:
        return None
    if not isinstance(value, str) or not WANDB_ID.fullmatch(value):
        raise StoreError(f"{source}: wandb_run_id={value!r} is not a W&B run id (1-64 of letters, digits, '_', "
                         f"'-'); remove the key to start a new W&B run")
    return value


class TensorBoardMirror:
    """TensorBoard scalars through ``torch.utils.tensorboard.SummaryWriter`` into ``log_dir``."""

    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """One scalar per name at ``step``, flushed (a SIGKILL after this loses none of them)."""
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=int(step))
        self.writer.flush()

    def log_generations(self, table: Mapping[str, list], step: int) -> None:
        """Validation generations as the markdown table ``val/generations`` (TensorBoard's Text tab)."""
        self.writer.add_text("val/generations", markdown_table(table), global_step=int(step))
        self.writer.flush()

    def close(self, status: str = "FINISHED") -> None:
        self.writer.close()


class WandbMirror:
    """A W&B run (``wandb.init``), offline unless ``WANDB_MODE`` is set.

    Args:
        run_id: the W&B run id (reused across a trajflow run's sessions).
        directory: where W&B puts its ``wandb/`` folder (None: ``WANDB_DIR``).
        project, name: the W&B project and run name.
        config: the resolved config, as a plain dict.
        system_metrics: let W&B sample CPU/memory (``tracking.system_metrics``).
    """

    name = "wandb"

    def __init__(self, run_id: str, directory: Path | None, project: str, name: str, config: dict,
                 system_metrics: bool) -> None:
        import wandb

        self.mode = os.environ.get("WANDB_MODE") or "offline"
        wanted = {"console": "off", "save_code": False, "silent": True, "x_disable_stats": not system_metrics,
                  # W&B flushes its .wandb file every 15 s by default: a killed session would lose that much.
                  "x_transaction_log_flush_interval": 1.0}
        fields = getattr(wandb.Settings, "model_fields", wanted)
        settings = wandb.Settings(**{k: v for k, v in wanted.items() if k in fields})
        kwargs = {"dir": str(directory)} if directory is not None else {}
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", config=config,
                              mode=self.mode, settings=settings, reinit="create_new", **kwargs)
        self.run_id = run_id
        self.dir = Path(self.run.dir).parent  # .../wandb/offline-run-<time>-<id>

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=int(step))

    def log_generations(self, table: Mapping[str, list], step: int) -> None:
        """Validation generations as the W&B table ``val/generations`` at ``step``."""
        import wandb

        columns = list(table)
        self.run.log({"val/generations": wandb.Table(columns=columns, data=[list(r) for r in
                                                                           zip(*(table[c] for c in columns))])},
                     step=int(step))

    def close(self, status: str = "FINISHED") -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def markdown_table(table: Mapping[str, list]) -> str:
    """``{column: values}`` as a markdown table, one row per entry (``|`` escaped, newlines as ``<br>``)."""
    def cell(v) -> str:
        return str(v).replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    columns = list(table)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in zip(*(table[c] for c in columns))]
    return "\n".join(lines)


def open_mirrors(cfg, store, run_name: str, *, out=None) -> list:
    """The mirrors ``trainer.logger`` names for the run in ``store``, opened, with one console line each.

    A W&B run id is taken from ``run.json`` (a resume) or made and written there. A directory an
    earlier session wrote to that differs from this session's is named in a note, not used.

    Args:
        cfg: the resolved config.
        store: the run's :class:`trajflow.store.RunStore`.
        run_name: the trajflow run id (W&B's default run name).
        out: where the console lines go (default: stdout; notes go to stderr).

    Returns:
        :class:`TensorBoardMirror` / :class:`WandbMirror` instances ([] for none).

    Raises:
        trajflow.errors.ConfigError: a named logger's package is missing, or W&B did not start
            (one line: the reason and the fix).
        trajflow.errors.StoreError: ``run.json`` holds a ``wandb_run_id`` that is not an id.
    """
    from trajflow.errors import ConfigError

    out = out or sys.stdout
    names = [n for n in logger_names(cfg) if n in MIRRORS]
    for n in names:
        if missing_package(n):
            raise ConfigError(f"trainer.logger: {n!r} needs the {missing_package(n)} package: {INSTALL_HINT}")
    mirrors: list = []
    meta = store.read_run_meta()
    try:
        if "tensorboard" in names:
            d = tensorboard_dir(store.run_dir)
            _note_moved("tensorboard_dir", "TENSORBOARD_DIR", meta, d, store)
            mirrors.append(TensorBoardMirror(d))
            store.update_run_meta(tensorboard_dir=str(d))
            print(f"tensorboard: writing to {d} (tensorboard --logdir {d})", file=out, flush=True)
        if "wandb" in names:
            mirrors.append(_open_wandb(cfg, store, meta, run_name, out))
    except BaseException:
        for m in mirrors:
            m.close("FAILED")
        raise
    return mirrors


def _open_wandb(cfg, store, meta: Mapping[str, Any], run_name: str, out) -> WandbMirror:
    from omegaconf import OmegaConf

    from trajflow.errors import ConfigError

    run_id = stored_wandb_id(meta, store.run_dir / "run.json")
    if run_id is None:
        import secrets

        run_id = secrets.token_hex(4)  # 8 of [0-9a-f], the shape of W&B's own ids
    d = wandb_dir(store.run_dir)
    _note_moved("wandb_dir", "WANDB_DIR", meta, d, store)
    project = _WANDB_PROJECT_BAD.sub("-", str(cfg.trainer.get("project_name") or f"trajflow-{cfg.recipe}"))[:128]
    name = str(cfg.trainer.get("experiment_name") or run_name)
    d.mkdir(parents=True, exist_ok=True)
    try:
        mirror = WandbMirror(run_id, None if os.environ.get("WANDB_DIR") else d, project, name,
                             OmegaConf.to_container(cfg, resolve=True), bool(cfg.tracking.system_metrics))
    except Exception as e:  # wandb's errors are multi-line and name its internals
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"trainer.logger: W&B did not start ({first}); unset WANDB_MODE for offline mode, "
                          f"or drop 'wandb' from trainer.logger") from None
    store.update_run_meta(wandb_run_id=run_id, wandb_dir=str(d))
    if mirror.mode == "offline":
        print(f"wandb: offline run {run_id} (project {project}, name {name}) in {mirror.dir.parent}; upload it "
              f"later with: wandb sync {mirror.dir.parent}/offline-run-*-{run_id}", file=out, flush=True)
    elif mirror.mode == "disabled":
        print("wandb: WANDB_MODE=disabled: W&B writes nothing", file=out, flush=True)
    else:
        print(f"wandb: run {run_id} (project {project}, name {name}, WANDB_MODE={mirror.mode}) in {mirror.dir}",
              file=out, flush=True)
    return mirror


def _note_moved(key: str, env: str, meta: Mapping[str, Any], now: Path, store) -> None:
    """One line when an earlier session wrote elsewhere: a run folder does not choose where this
    session writes (the recorded path is only shown)."""
    before = meta.get(key)
    if isinstance(before, str) and before != str(now):
        print(f"note: {store.run_dir / 'run.json'} says earlier sessions wrote to {key}={before!r}; this session "
              f"writes to {now} (set {env} to that path to continue there)", file=sys.stderr, flush=True)
