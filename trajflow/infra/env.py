"""Process environment for embedded runs: set before Prefect, Ray, MLflow or GX are imported.

Values are defaults only (``setdefault``): anything the user exported wins.
"""

from __future__ import annotations

import os

DEFAULTS = {
    # Prefect without a server starts a temporary local one; on a fresh PREFECT_HOME that can take
    # 11-25 s on 2 cores, longer than Prefect's default 20 s start-up timeout.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "GX_ANALYTICS_ENABLED": "false",
    # Nothing may be fetched from a model hub at run time.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "DS_ACCELERATOR": "cpu",
    # glibc malloc: two arenas per process instead of up to 8 per core. Ray's and Prefect's processes
    # allocate from many threads, and every arena keeps what its threads freed (measured on the
    # default recipe: docs/scaling.md, "Memory allocator"). Read by every process started from here
    # on (Ray's GCS, raylet, agents and workers, Prefect's server); this one applies it with mallopt.
    "MALLOC_ARENA_MAX": "2",
}


def configure_environment() -> None:
    """Apply :data:`DEFAULTS` to ``os.environ`` without overriding user settings, and this process's
    own ``MALLOC_ARENA_MAX`` (:func:`trajflow.infra.allocator.limit_malloc_arenas`)."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    from trajflow.infra.allocator import limit_malloc_arenas

    try:
        limit_malloc_arenas(int(os.environ["MALLOC_ARENA_MAX"]))
    except ValueError:  # a value glibc would ignore too
        pass
