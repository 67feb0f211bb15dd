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
}


def configure_environment() -> None:
    """Apply :data:`DEFAULTS` to ``os.environ`` without overriding user settings."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
