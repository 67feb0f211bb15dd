"""The run store: every stage output of every iteration, as files that can be verified.

Layout under ``<root>/<run_id>/``::

    config.yaml                       the resolved config
    run.json                          run metadata (recipe, parent run for replays, status)
    iterations/000007/rollout.parquet, reward.parquet, advantage.parquet (zstd), update.json,
                      gate.json, manifest.json
    checkpoints/000008/               see trajflow.checkpoint
    final/                            the exported Hugging Face model

Writes are atomic: a temp file in the same folder, ``fsync``, ``rename``, ``fsync`` of the folder;
only then is the file recorded (sha256, rows, columns) in the iteration's ``manifest.json``, which is
itself replaced atomically. A reader therefore never sees a half-written file, and a file that is
on disk but not in the manifest (a crash between rename and manifest) is simply recomputed.

A stage output is reused (resume, retry) only if it *verifies*: the file's sha256 matches the
manifest, it opens as Parquet, and the sha256 of the inputs it was computed from (recorded as
``inputs`` in its manifest entry) equal those of the inputs at hand. So when an upstream file is
recomputed with different bytes, everything computed from it is recomputed too; when it comes back
identical, nothing downstream is rewritten.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from trajflow.errors import StoreError
from trajflow.stages.names import STORED_STAGES
from trajflow.batch import SCHEMA_VERSION, upgrade_stage_table
from trajflow.faults import fault_point

log = logging.getLogger(__name__)

#: Longest run id: file systems allow 255 bytes per name, and replay ids add ~40 to their parent's.
MAX_RUN_ID_BYTES = 200

#: The stages whose outputs are Parquet files, in join order.
STAGES = STORED_STAGES


@dataclass(frozen=True)
class StageRef:
    """A reference to one stored stage output: what Prefect tasks pass instead of data."""

    iteration: int
    stage: str
    path: str
    sha256: str
    rows: int


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where Linux reports it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def run_folders(root: str | Path) -> list[Path]:
    """The run folders under a store root, by name: folders holding a ``config.yaml``, hidden ones
    (``.name``, not a valid run id) left out; ``[]`` when ``root`` is not a folder."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and (p / "config.yaml").is_file())


def follow_umask(root: str | Path) -> None:
    """Give every file under ``root`` (or ``root`` itself) the mode a plain ``open`` would: ``0o666 & ~umask``.

    safetensors and ``mkstemp`` create files 0600, which would make a run's weights unreadable to
    the colleagues the umask means to share them with.
    """
    mode = 0o666 & ~_umask()
    root = Path(root)
    for p in ([root] if root.is_file() else root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)


def _atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Run ``write(temp_path)``, fsync the temp file, rename it to ``path``, fsync the folder.

    A temp file in the same folder (``.<name>.*.tmp``) is removed when ``write`` raises; a process
    killed before the rename leaves only that temp file (see :meth:`RunStore.cleanup_temp`).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a run's files follow the umask like any other
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        fault_point("store_write")
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            # Not a bug: the store's disk is full or read-only. Nothing half-written is left behind.
            raise StoreError(f"cannot write {path}: {e.strerror}; free space on (or remount) the store's disk, "
                             f"then resume the run") from None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    _atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())


def atomic_write_parquet(path: Path, table: pa.Table) -> None:
    """Write a zstd Parquet file atomically (temp file, fsync, rename, fsync folder)."""
    _atomic_write(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


@contextmanager
def run_lock(store: "RunStore") -> Iterator[None]:
    """Hold the run's lock (``<run>/.lock``) for the ``with`` block: one driver per run at a time.

    The lock is an OS file lock (``filelock``): the kernel releases it when its holder exits, however
    it exits, so a SIGKILLed driver never blocks the next ``resume``. Who holds it (pid, host, since
    when) is written beside it in ``.lock.json``, for the refusal's message.

    Raises:
        StoreError: another process holds the lock (names it); nothing was changed.
    """
    import socket

    from filelock import FileLock, Timeout

    store.run_dir.mkdir(parents=True, exist_ok=True)
    holder_path = store.run_dir / ".lock.json"
    lock_path = store.run_dir / ".lock"
    if lock_path.exists() and not lock_path.is_file():
        raise StoreError(f"{lock_path}: the run's lock is a {'folder' if lock_path.is_dir() else 'special file'}, "
                         f"not a file; remove it (no trajflow process made it), then run this again")
    lock = FileLock(str(lock_path), thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            h = json.loads(holder_path.read_text())
            since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(h["since"]))
            who = f"pid {h['pid']} on {h['host']} since {since}"
        except (OSError, ValueError, KeyError, TypeError):
            who = "another process"
        raise StoreError(f"run {store.run_id!r} is in use by {who} (lock {store.run_dir / '.lock'}); wait "
                         f"for it to finish or stop it, then run this again") from None
    except OSError as e:  # not the lock being held (that is Timeout): the file cannot be opened at all
        raise StoreError(f"{lock_path}: cannot open the run's lock ({e.strerror or e}); check the folder's "
                         f"permissions, then run this again") from None
    try:
        atomic_write_json(holder_path, {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        yield
    finally:
        lock.release()


class RunStore:
    """Files of one run. Cheap to construct; holds no open handles.

    Args:
        root: the store root (``store.root``).
        run_id: the run's id (a folder name: letters, digits, ``-``, ``_``, ``.``).

    Raises:
        StoreError: ``run_id`` is not a plain folder name.
    """

    def __init__(self, root: str | Path, run_id: str) -> None:
        if not run_id or "/" in run_id or run_id in (".", "..") or run_id.startswith("."):
            raise StoreError(f"run id {run_id!r} is not a valid folder name")
        if not run_id.isprintable():  # a newline or other control character: a folder no listing shows right
            raise StoreError(f"run id {run_id!r} holds a control character (newline, tab, ...); use letters, "
                             f"digits, '-', '_' and '.'")
        if len(run_id.encode()) > MAX_RUN_ID_BYTES:
            raise StoreError(f"run id {run_id[:40]}... is {len(run_id.encode())} bytes long; at most "
                             f"{MAX_RUN_ID_BYTES} (it is a folder name, and derived names such as replays' "
                             f"add to it)")
        self.root = Path(root).expanduser().resolve()
        self.run_id = run_id
        self.run_dir = self.root / run_id

    # ---- paths
    def iteration_dir(self, iteration: int) -> Path:
        return self.run_dir / "iterations" / f"{iteration:06d}"

    def checkpoints_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def final_dir(self) -> Path:
        return self.run_dir / "final"

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.yaml"

    def exists(self) -> bool:
        return self.config_path.exists()

    # ---- run-level metadata
    def write_config(self, yaml_text: str) -> None:
        atomic_write_bytes(self.config_path, yaml_text.encode())

    def read_config(self):
        """The run's stored ``config.yaml`` as an OmegaConf ``DictConfig``: the one loader for it
        (resume, replay, ``trajflow gate``, evaluate), so that no command proceeds on a config the
        run did not record.

        Raises:
            StoreError: the file is missing, not UTF-8, not YAML, empty, or not a mapping (names the
                file; the run's config cannot be guessed, so nothing falls back to the defaults).
        """
        import yaml
        from omegaconf import OmegaConf

        p = self.config_path
        fix = "restore it from a backup or start a new run"
        try:
            text = p.read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise StoreError(f"{p}: missing; run {self.run_id!r} has no stored config ({fix})") from None
        except UnicodeDecodeError as e:
            raise StoreError(f"{p}: not UTF-8 text (byte {e.start}); the stored config is damaged ({fix})") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            raise StoreError(f"{p}: not valid YAML{at} ({getattr(e, 'problem', None) or e}); the stored "
                             f"config is damaged ({fix})") from None
        if data is None:
            raise StoreError(f"{p}: empty; the stored config is lost ({fix}); refusing to continue with "
                             f"the built-in defaults")
        if not isinstance(data, dict):
            raise StoreError(f"{p}: holds a {type(data).__name__}, not a mapping of config sections; the "
                             f"stored config is damaged ({fix})")
        return OmegaConf.create(data)

    def read_run_meta(self) -> dict:
        """``run.json`` as a dict (``{}`` when there is none).

        Raises:
            StoreError: it is not UTF-8 JSON holding an object (names the file); nothing falls back
                to an empty record, which :meth:`update_run_meta` would write over the damaged one.
        """
        p = self.run_dir / "run.json"
        if not p.exists():
            return {}
        try:
            meta = json.loads(p.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise StoreError(f"{p}: not valid JSON ({str(e).splitlines()[0]}); the run's record is damaged: "
                             f"restore it from a backup, or delete it to let trajflow write a new one") from None
        if not isinstance(meta, dict):
            raise StoreError(f"{p}: holds a JSON {type(meta).__name__}, not an object; the run's record is "
                             f"damaged: restore it from a backup, or delete it to let trajflow write a new one")
        return meta

    def update_run_meta(self, **fields: Any) -> dict:
        meta = self.read_run_meta()
        meta.update(fields)
        atomic_write_json(self.run_dir / "run.json", meta)
        return meta

    # ---- manifests
    def manifest_path(self, iteration: int) -> Path:
        return self.iteration_dir(iteration) / "manifest.json"

    def read_manifest(self, iteration: int) -> dict:
        p = self.manifest_path(iteration)
        if not p.exists():
            return {"iteration": iteration, "schema_version": SCHEMA_VERSION, "status": "in_progress",
                    "files": {}}
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise StoreError(f"{p}: manifest is not valid JSON ({e})") from None

    def _update_manifest(self, iteration: int, **fields: Any) -> dict:
        m = self.read_manifest(iteration)
        for k, v in fields.items():
            if k == "files":
                m.setdefault("files", {}).update(v)
            else:
                m[k] = v
        atomic_write_json(self.manifest_path(iteration), m)
        return m

    def iterations(self) -> list[int]:
        d = self.run_dir / "iterations"
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []

    def is_complete(self, iteration: int) -> bool:
        return self.read_manifest(iteration).get("status") == "complete"

    def mark(self, iteration: int, status: str, **fields: Any) -> None:
        """Set an iteration's status (``in_progress``, ``gated``, ``complete``) plus extra fields."""
        self._update_manifest(iteration, status=status, **fields)

    # ---- stage outputs
    def stage_path(self, iteration: int, stage: str) -> Path:
        return self.iteration_dir(iteration) / f"{stage}.parquet"

    def write_stage(self, iteration: int, stage: str, table: pa.Table, policy_version: int,
                    inputs: dict[str, str] | None = None, meta: dict[str, Any] | None = None) -> StageRef:
        """Write a stage's table atomically, then record it in the manifest.

        Args:
            iteration: iteration number.
            stage: ``rollout``, ``reward`` or ``advantage``.
            table: the columns this stage produces, keyed by ``sample_id``.
            policy_version: the policy version that produced the iteration's rollouts.
            inputs: ``{name: sha256}`` of what the table was computed from (upstream stage files, the
                gate's quarantine list); :meth:`verified_stage` reuses the file only for equal inputs.
            meta: small JSON-serialisable facts kept in the manifest entry (e.g. the stage's metrics,
                the checkpoint the rollout policy came from), returned by :meth:`stage_entry`.

        Raises:
            StoreError: ``table`` has no ``sample_id`` column or repeats an id.
        """
        if "sample_id" not in table.column_names:
            raise StoreError(f"{stage} output has no 'sample_id' column")
        if len(set(table.column("sample_id").to_pylist())) != table.num_rows:
            raise StoreError(f"{stage} output repeats a sample_id")
        path = self.stage_path(iteration, stage)
        atomic_write_parquet(path, table)
        digest = sha256_file(path)
        entry = {"file": path.name, "sha256": digest, "rows": table.num_rows, "columns": table.column_names,
                 "inputs": dict(inputs or {}), "meta": dict(meta or {}), "written_at": time.time()}
        self._update_manifest(iteration, policy_version=policy_version, schema_version=SCHEMA_VERSION,
                              files={stage: entry})
        return StageRef(iteration, stage, str(path), digest, table.num_rows)

    def stage_entry(self, iteration: int, stage: str) -> dict | None:
        """The manifest entry of a stored stage output (``sha256``, ``rows``, ``inputs``, ``meta``...)."""
        return self.read_manifest(iteration).get("files", {}).get(stage)

    def stage_problem(self, iteration: int, stage: str) -> str | None:
        """Why the stored output of ``stage`` in ``iteration`` cannot be read back (``None`` when it
        verifies): for commands that report an unusable iteration instead of recomputing it."""
        if not self.manifest_path(iteration).exists():
            return f"{self.manifest_path(iteration)} is missing"
        if self.stage_entry(iteration, stage) is None:
            return f"no {stage} output recorded in {self.manifest_path(iteration)}"
        path = self.stage_path(iteration, stage)
        if not path.exists():
            return f"{path} is missing"
        if self.verified_stage(iteration, stage, warn=False) is None:
            return f"{path} is truncated or does not match its manifest's sha256"
        return None

    def verified_stage(self, iteration: int, stage: str, *, warn: bool = True,
                       inputs: dict[str, str] | None = None) -> StageRef | None:
        """The stage's reference if its file exists, is readable and matches the manifest's sha256.

        A file that is recorded but does not verify (hash mismatch, truncation) is reported with a
        warning naming it and ``None`` is returned, so the caller recomputes it. With ``inputs``, a
        file computed from other inputs (``inputs`` differ from the recorded ones) is stale: ``None``
        too, with an info line.
        """
        entry = self.read_manifest(iteration).get("files", {}).get(stage)
        path = self.stage_path(iteration, stage)
        if entry is None or not path.exists():
            return None
        if inputs is not None and entry.get("inputs", {}) != inputs:
            log.info("stored %s was computed from other inputs than the current ones: it will be recomputed",
                     path)
            return None
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            if warn:
                log.warning("stored %s does not match its manifest (sha256 %s..., expected %s...): "
                            "it will be recomputed", path, digest[:12], entry["sha256"][:12])
            return None
        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except Exception as e:  # truncated or not Parquet at all
            if warn:
                log.warning("stored %s is unreadable (%s): it will be recomputed", path, e)
            return None
        return StageRef(iteration, stage, str(path), digest, rows)

    def read_stage(self, iteration: int, stage: str, *, verify: bool = True) -> pa.Table:
        """Read a stored stage output.

        Raises:
            StoreError: missing, not recorded, or (with ``verify``) not matching its manifest.
        """
        path = self.stage_path(iteration, stage)
        if verify:
            ref = self.verified_stage(iteration, stage, warn=False)
            if ref is None:
                raise StoreError(f"{path}: missing or does not match {self.manifest_path(iteration).name}")
        try:
            return upgrade_stage_table(pq.read_table(path))
        except Exception as e:
            raise StoreError(f"{path}: cannot be read as Parquet ({e})") from None

    def read_ref(self, ref: StageRef) -> pa.Table:
        """Read the table behind a reference, checking its hash first."""
        if sha256_file(ref.path) != ref.sha256:
            raise StoreError(f"{ref.path}: changed since it was written (sha256 mismatch)")
        return upgrade_stage_table(pq.read_table(ref.path))

    def copy_stage_from(self, source: "RunStore", iteration: int, stage: str) -> StageRef:
        """Copy a verified stage output of another run (a replay's parent) into this run, byte for byte.

        The manifest entry (sha256, inputs, meta) is carried over, so the copy verifies exactly like
        the original; a ``meta.checkpoint_id`` of the source run (``checkpoints/...``) is prefixed
        with its run id, so it keeps naming the same weights.

        Raises:
            StoreError: the source file is missing or does not verify.
        """
        ref = source.verified_stage(iteration, stage)
        if ref is None:
            raise StoreError(f"{source.stage_path(iteration, stage)}: missing or does not match "
                             f"{source.manifest_path(iteration)}; cannot copy it")
        entry = dict(source.stage_entry(iteration, stage) or {})
        src_manifest = source.read_manifest(iteration)
        path = self.stage_path(iteration, stage)
        atomic_write_bytes(path, Path(ref.path).read_bytes())
        digest = sha256_file(path)
        if digest != ref.sha256:  # pragma: no cover - the source changed while we copied it
            raise StoreError(f"{ref.path}: changed while it was copied to {path}")
        entry["copied_from"] = f"{source.run_id}/{Path(ref.path).relative_to(source.run_dir)}"
        meta = dict(entry.get("meta") or {})
        if str(meta.get("checkpoint_id", "")).startswith("checkpoints/"):
            meta["checkpoint_id"] = f"{source.run_id}/{meta['checkpoint_id']}"
        entry["meta"] = meta
        self._update_manifest(iteration, policy_version=src_manifest.get("policy_version"),
                              schema_version=src_manifest.get("schema_version", SCHEMA_VERSION),
                              files={stage: entry})
        return StageRef(iteration, stage, str(path), digest, ref.rows)

    def cleanup_temp(self) -> list[Path]:
        """Delete temp files a killed writer left behind (``.<name>.*.tmp``, ``.final-tmp``).

        No reader ever opens them, so this is housekeeping, safe whenever no writer of this run is alive.

        Returns:
            The paths removed.
        """
        import shutil

        removed: list[Path] = []
        dirs = [self.run_dir] + [self.iteration_dir(i) for i in self.iterations()]
        for d in dirs:
            if not d.exists():
                continue
            for p in d.iterdir():
                if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file():
                    p.unlink(missing_ok=True)
                    removed.append(p)
        final_tmp = self.run_dir / ".final-tmp"
        if final_tmp.exists():
            shutil.rmtree(final_tmp, ignore_errors=True)
            removed.append(final_tmp)
        return removed

    def write_iteration_json(self, iteration: int, name: str, obj: Any) -> Path:
        """Atomically write ``<iteration>/<name>`` (e.g. ``update.json``) and record its hash."""
        path = self.iteration_dir(iteration) / name
        atomic_write_json(path, obj)
        self._update_manifest(iteration, files={Path(name).stem: {"file": name, "sha256": sha256_file(path)}})
        return path

    def read_iteration_json(self, iteration: int, name: str) -> Any | None:
        path = self.iteration_dir(iteration) / name
        return json.loads(path.read_text()) if path.exists() else None
