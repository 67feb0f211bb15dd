"""Register trajflow's Prefect deployments, work pools and queues on a Prefect server.

The definitions are files, not code: ``infra/prefect/prefect.yaml`` (deployments in Prefect's own
format) and ``infra/prefect/work-pools.yaml`` (work pools and queues with concurrency limits).
:func:`deploy` (``trajflow deploy``) creates or updates the pools and queues, then each deployment;
running it again is harmless (an existing deployment is replaced in place, schedules included).
Placeholders ``{{ $VAR }}`` come from the environment; ``TRAJFLOW_SOURCE``, the working directory of
the deployments' flow runs (their ``runs/`` store), defaults to ``--source``, else the folder
``trajflow deploy`` is called from; ``TRAJFLOW_PYTHONPATH`` defaults to :func:`default_pythonpath`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from trajflow import IMPORT_ROOT, LAYOUT_ROOT
from trajflow.errors import DeployError

#: The definitions: ``infra/prefect/`` of the repository (``trajflow/infra/prefect/`` when installed).
INFRA_DIR = LAYOUT_ROOT / "infra" / "prefect"
PREFECT_FILE = INFRA_DIR / "prefect.yaml"
POOLS_FILE = INFRA_DIR / "work-pools.yaml"

#: Deployments registered only when their entrypoint's module defines the flow.
OPTIONAL_DEPLOYMENTS = ("replay",)

_PLACEHOLDER = re.compile(r"\{\{\s*\$([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


@dataclass
class QueueSpec:
    """A work queue of a pool."""

    name: str
    concurrency_limit: int | None = None
    priority: int | None = None
    description: str | None = None


@dataclass
class PoolSpec:
    """A work pool (one per device pool) and its queues."""

    name: str
    type: str = "process"
    description: str | None = None
    concurrency_limit: int | None = None
    queues: list[QueueSpec] = field(default_factory=list)


@dataclass
class DeploymentSpec:
    """One deployment of ``prefect.yaml``, placeholders resolved."""

    name: str
    entrypoint: str
    work_pool: str
    work_queue: str | None = None
    description: str | None = None
    tags: list[str] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    schedules: list[dict[str, Any]] = field(default_factory=list)
    job_variables: dict[str, Any] = field(default_factory=dict)
    pull_steps: list[dict[str, Any]] = field(default_factory=list)
    concurrency_limit: int | None = None


def resolve_placeholders(obj: Any, env: Mapping[str, str], where: str = "") -> Any:
    """Replace ``{{ $VAR }}`` in every string of ``obj`` (dicts and lists recursively) with ``env[VAR]``.

    Raises:
        DeployError: a variable is not set (names it and where it is used).
    """
    if isinstance(obj, dict):
        return {k: resolve_placeholders(v, env, f"{where}.{k}" if where else str(k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [resolve_placeholders(v, env, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, str):
        def sub(m: re.Match) -> str:
            if m.group(1) not in env:
                raise DeployError(f"{where}: environment variable {m.group(1)} is not set")
            return env[m.group(1)]

        return _PLACEHOLDER.sub(sub, obj)
    return obj


def _read_yaml(path: Path) -> dict:
    if not path.exists():
        raise DeployError(f"{path}: file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise DeployError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise DeployError(f"{path}: expected a mapping at the top level")
    return data


def load_pools(path: Path = POOLS_FILE, pool: str | None = None) -> list[PoolSpec]:
    """The work pools of ``work-pools.yaml``; ``pool`` renames its only pool.

    Raises:
        DeployError: missing names, bad limits, or ``pool`` given for a file with several pools.
    """
    data = _read_yaml(path)
    pools = []
    for i, p in enumerate(data.get("work_pools") or []):
        where = f"{path}: work_pools[{i}]"
        if not isinstance(p, dict) or not p.get("name"):
            raise DeployError(f"{where}: needs a name")
        queues = []
        for j, q in enumerate(p.get("queues") or []):
            if not isinstance(q, dict) or not q.get("name"):
                raise DeployError(f"{where}.queues[{j}]: needs a name")
            limit = q.get("concurrency_limit")
            if limit is not None and (not isinstance(limit, int) or limit < 0):
                raise DeployError(f"{where}.queues[{j}].concurrency_limit={limit!r}: expected an integer >= 0")
            queues.append(QueueSpec(q["name"], limit, q.get("priority"), q.get("description")))
        pools.append(PoolSpec(p["name"], p.get("type", "process"), p.get("description"), p.get("concurrency_limit"),
                              queues))
    if pool is not None:
        if len(pools) != 1:
            raise DeployError(f"{path}: --pool renames the file's only work pool, but it defines {len(pools)}")
        pools[0].name = pool
    return pools


def default_pythonpath(source: Path) -> str:
    """The workers' ``PYTHONPATH``: the source folder (a user's own reward or environment modules import
    from it), then, when this trajflow runs from a source checkout rather than an installed package,
    that checkout, so that the flow process and its Ray workers import this same trajflow."""
    parts = [str(source)]
    if LAYOUT_ROOT == IMPORT_ROOT and IMPORT_ROOT != source:
        parts.append(str(IMPORT_ROOT))
    return os.pathsep.join(parts)


def load_deployments(path: Path = PREFECT_FILE, source: Path | None = None, pool: str | None = None,
                     env: Mapping[str, str] | None = None) -> list[DeploymentSpec]:
    """The deployments of ``prefect.yaml``, placeholders resolved, top-level pull steps applied.

    Args:
        path: the ``prefect.yaml``.
        source: the working directory of the flow runs on the workers (``TRAJFLOW_SOURCE`` unless
            exported; default: the current directory).
        pool: put every deployment on this work pool instead of the file's.
        env: variables for placeholders (default: ``os.environ``).

    Raises:
        DeployError: a deployment lacks a name, entrypoint or work pool, or a placeholder is unset.
    """
    env = dict(os.environ if env is None else env)
    source = Path(source or Path.cwd()).resolve()
    env.setdefault("TRAJFLOW_SOURCE", str(source))
    env.setdefault("TRAJFLOW_PYTHONPATH", default_pythonpath(source))
    data = _read_yaml(path)
    data.pop("definitions", None)  # anchors only; already expanded by the YAML loader
    data = resolve_placeholders(data, env, path.name)
    specs = []
    for i, d in enumerate(data.get("deployments") or []):
        where = f"{path}: deployments[{i}]"
        if not isinstance(d, dict) or not d.get("name") or not d.get("entrypoint"):
            raise DeployError(f"{where}: needs a name and an entrypoint")
        wp = d.get("work_pool") or {}
        if not (pool or wp.get("name")):
            raise DeployError(f"{where} ({d['name']}): needs work_pool.name")
        specs.append(DeploymentSpec(
            name=d["name"], entrypoint=d["entrypoint"], work_pool=pool or wp["name"],
            work_queue=wp.get("work_queue_name"), description=d.get("description"), tags=list(d.get("tags") or []),
            parameters=dict(d.get("parameters") or {}), schedules=list(d.get("schedules") or []),
            job_variables=dict(wp.get("job_variables") or {}), pull_steps=list(d.get("pull") or data.get("pull") or []),
            concurrency_limit=d.get("concurrency_limit")))
    return specs


def schedule_create(spec: Mapping[str, Any], where: str = "schedule") -> Any:
    """A ``DeploymentScheduleCreate`` from a ``prefect.yaml`` schedule (``cron`` or ``interval``).

    Raises:
        DeployError: neither ``cron`` nor ``interval``, or an invalid cron string or time zone.
    """
    from datetime import timedelta

    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule, IntervalSchedule

    try:
        if "cron" in spec:
            sched = CronSchedule(cron=spec["cron"], timezone=spec.get("timezone"), day_or=spec.get("day_or", True))
        elif "interval" in spec:
            sched = IntervalSchedule(interval=timedelta(seconds=float(spec["interval"])),
                                     timezone=spec.get("timezone"))
        else:
            raise DeployError(f"{where}: needs 'cron' or 'interval' (got {sorted(spec)})")
        return DeploymentScheduleCreate(schedule=sched, active=bool(spec.get("active", True)),
                                        parameters=dict(spec.get("parameters") or {}))
    except DeployError:
        raise
    except Exception as e:  # pydantic: bad cron, unknown time zone
        raise DeployError(f"{where}: {str(e).splitlines()[0]}") from None


def _module_file(entrypoint: str) -> tuple[str, Path | None]:
    """The module of an entrypoint (``package.module.function``) and its file (None: not found); the
    module is located, not imported."""
    import importlib.util

    module = entrypoint.rsplit(".", 1)[0]
    importlib.invalidate_caches()  # a module written since the last lookup
    try:
        spec = importlib.util.find_spec(module)
    except ImportError:  # a parent package is missing
        spec = None
    return module, Path(spec.origin) if spec is not None and spec.origin else None


def skip_reason(spec: DeploymentSpec) -> str | None:
    """Why an optional deployment is skipped (its entrypoint's flow does not exist yet); None: register it."""
    if spec.name not in OPTIONAL_DEPLOYMENTS:
        return None
    module, path = _module_file(spec.entrypoint)
    if path is None or not path.is_file():
        return f"module {module} does not exist"
    func = spec.entrypoint.rsplit(".", 1)[-1]
    if not re.search(rf"^(async\s+)?def\s+{re.escape(func)}\s*\(", path.read_text(), re.M):
        return f"{path.name} does not define {func}"
    return None


def _load_flow(entrypoint: str) -> Any:
    from prefect.flows import load_flow_from_entrypoint

    try:
        return load_flow_from_entrypoint(entrypoint, use_placeholder_flow=False)
    except Exception as e:
        raise DeployError(f"entrypoint {entrypoint!r} cannot be loaded: {type(e).__name__}: {e}") from e


def ensure_pools(client: Any, pools: list[PoolSpec]) -> list[str]:
    """Create missing work pools and queues; set the concurrency limits of existing ones.

    Returns:
        One line per pool/queue saying what was done.

    Raises:
        DeployError: an existing pool has another type.
    """
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    done = []
    for p in pools:
        try:
            existing = client.read_work_pool(p.name)
        except ObjectNotFound:
            existing = None
        if existing is None:
            client.create_work_pool(WorkPoolCreate(name=p.name, type=p.type, description=p.description,
                                                   base_job_template=_base_job_template(p.type),
                                                   concurrency_limit=p.concurrency_limit))
            done.append(f"created work pool {p.name} ({p.type})")
        else:
            if existing.type != p.type:
                raise DeployError(f"work pool {p.name!r} exists with type {existing.type!r}, not {p.type!r}")
            client.update_work_pool(p.name, WorkPoolUpdate(description=p.description,
                                                           concurrency_limit=p.concurrency_limit))
            done.append(f"updated work pool {p.name}")
        for q in p.queues:
            fields: dict[str, Any] = {"concurrency_limit": q.concurrency_limit}  # None: no limit
            if q.priority is not None:
                fields["priority"] = q.priority
            if q.description is not None:
                fields["description"] = q.description
            try:
                wq = client.read_work_queue_by_name(q.name, work_pool_name=p.name)
                client.update_work_queue(wq.id, **fields)
            except ObjectNotFound:
                client.create_work_queue(q.name, work_pool_name=p.name, **fields)
            done.append(f"  queue {p.name}/{q.name}: concurrency limit {q.concurrency_limit}")
    return done


def _base_job_template(pool_type: str) -> dict:
    if pool_type == "process":
        from prefect.workers.process import ProcessWorker

        return ProcessWorker.get_default_base_job_template()
    from prefect.utilities.asyncutils import run_coro_as_sync
    from prefect.workers.utilities import get_default_base_job_template_for_infrastructure_type

    template = run_coro_as_sync(get_default_base_job_template_for_infrastructure_type(pool_type))
    if template is None:
        raise DeployError(f"unknown work pool type {pool_type!r} (is its Prefect integration installed?)")
    return template


def register(client: Any, spec: DeploymentSpec, version: str | None = None) -> Any:
    """Create or update one deployment; returns its id.

    Raises:
        DeployError: the entrypoint cannot be loaded or a schedule is invalid.
    """
    from prefect.utilities.callables import parameter_schema

    flow = _load_flow(spec.entrypoint)
    schedules = [schedule_create(s, f"{spec.name}.schedules[{i}]") for i, s in enumerate(spec.schedules)]
    flow_id = client.create_flow_from_name(flow.name)
    return client.create_deployment(
        flow_id=flow_id, name=spec.name, version=version, description=spec.description or flow.description,
        tags=spec.tags, parameters=spec.parameters, entrypoint=spec.entrypoint, path=None,
        pull_steps=spec.pull_steps, work_pool_name=spec.work_pool, work_queue_name=spec.work_queue,
        job_variables=spec.job_variables, schedules=schedules, concurrency_limit=spec.concurrency_limit,
        parameter_openapi_schema=parameter_schema(flow).model_dump(exclude_unset=True),
        enforce_parameter_schema=True)


def api_url(server: str | None) -> str:
    """The Prefect API URL to register with: ``server`` (``/api`` appended if missing), else the
    configured ``PREFECT_API_URL``.

    Raises:
        DeployError: neither is set (Prefect would otherwise write to a throw-away local server).
    """
    if server:
        url = server.rstrip("/")
        return url if url.endswith("/api") else url + "/api"
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        raise DeployError("no Prefect server: pass --server URL (e.g. http://127.0.0.1:4200) or set "
                          "PREFECT_API_URL; start a local one with 'prefect server start'")
    return str(url)


def deploy(server: str | None = None, source: str | Path | None = None, pool: str | None = None,
           prefect_file: str | Path = PREFECT_FILE, pools_file: str | Path = POOLS_FILE,
           echo: Any = print) -> dict[str, Any]:
    """Register the work pools, queues and deployments on a Prefect server.

    Args:
        server: the server's URL (default: ``PREFECT_API_URL``).
        source: the working directory of the flow runs on the worker machines, where their ``runs/``
            store goes (default: the current directory).
        pool: use this work pool name instead of the one in the files.
        prefect_file: the deployments file.
        pools_file: the work pools file.
        echo: where progress lines go.

    Returns:
        ``{"api_url", "pools": [names], "deployments": {name: id}, "skipped": {name: reason}}``.

    Raises:
        DeployError: bad definitions, an unreachable server, an entrypoint that does not load.
    """
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from trajflow.tracking import git_commit

    source = Path(source or Path.cwd()).resolve()
    url = api_url(server)
    pools = load_pools(Path(pools_file), pool)
    specs = load_deployments(Path(prefect_file), source, pool)
    version = git_commit()
    out: dict[str, Any] = {"api_url": url, "pools": [p.name for p in pools], "deployments": {}, "skipped": {}}
    with temporary_settings(updates={PREFECT_API_URL: url}):
        with get_client(sync_client=True) as client:
            healthy = client.api_healthcheck()
            if healthy is not None:
                raise DeployError(f"cannot reach the Prefect server at {url}: {healthy}")
            for line in ensure_pools(client, pools):
                echo(line)
            for spec in specs:
                reason = skip_reason(spec)
                if reason:
                    out["skipped"][spec.name] = reason
                    echo(f"skipped deployment {spec.name}: {reason}")
                    continue
                dep_id = register(client, spec, version)
                out["deployments"][spec.name] = str(dep_id)
                sched = ", ".join(s.get("cron") or f"every {s.get('interval')} s" for s in spec.schedules)
                echo(f"deployment {spec.name} -> {spec.work_pool}/{spec.work_queue or 'default'}"
                     f"{' schedule ' + sched if sched else ''} ({spec.entrypoint})")
    echo(f"flow runs work in {source} on the workers: runs and their MLflow store go to {source / 'runs'} "
         f"(--source DIR to change)")
    out["source"] = str(source)
    return out
