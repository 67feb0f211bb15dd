"""The one spelling of a metric name that every surface shows: console, ``run.json``, MLflow, the
dashboard, ``trajflow compare``, ``trajflow runs``, Prefect artifacts.

verl names its validation metrics ``val-core/<data_source>/acc/mean@<n>`` (``pass@k``, ``maj@k``,
``best@k`` likewise) and prints them so on its console, but MLflow refuses ``@`` in a metric name,
so verl's MLflow adapter logs ``mean_at_<n>`` instead: a verl user sees two names for one number.
trajflow names each metric once, with :func:`metric_name`, where it is computed: ``@`` written as
``_at_`` (verl's MLflow spelling) and every other character MLflow rejects as ``_``. The name on the
console is then the name in MLflow, in ``run.json``, on the dashboard and in ``compare``.

What a user types (``trajflow compare --metric``, ``trainer.keep_best``) goes through the same
function, so verl's ``mean@1`` and ``mean_at_1`` both find the metric; readers of files written
before this spelling (``run.json`` validation entries with ``@``) map their keys through it too.
"""

from __future__ import annotations

import hashlib
import posixpath
import re

#: MLflow's metric-name length limit (``MAX_ENTITY_KEY_LENGTH``).
MLFLOW_MAX_NAME = 250
# What MLflow accepts in a metric name (mlflow.utils.validation, POSIX): word characters, '/', '.',
# '-', ' ' and ':'.
_BAD_CHARS = re.compile(r"[^/\w.\- :]")
GLOB_CHARS = "*?[]"


def name_hash(name: str) -> str:
    """8 hex digits of ``sha256(name)``: the suffix that keeps cut or colliding names apart."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()[:8]


def metric_name(name: str, *, keep: str = "") -> str:
    """A metric name as trajflow shows and logs it (``val-core/x/acc/mean@1`` -> ``.../mean_at_1``).

    ``@`` becomes ``_at_`` (as verl's MLflow adapter writes it), every other character MLflow rejects
    becomes ``_`` (``timing(s)/gen`` -> ``timing_s_/gen``, ``val-core/a+b/acc`` -> ``val-core/a_b/acc``),
    path segments MLflow would normalise away (empty, ``.``, ``..``) become ``_``/``__``, and a name
    over :data:`MLFLOW_MAX_NAME` characters is cut and ends in :func:`name_hash`. Idempotent
    (``metric_name(metric_name(x)) == metric_name(x)`` for names within the length limit); not
    injective: :meth:`trajflow.tracking.Tracker.metric_name` keeps names that collide apart.

    Args:
        name: the metric name (verl's spelling or this one).
        keep: characters left as they are: :data:`GLOB_CHARS` for a pattern
            (``trajflow compare --metric 'val-core/*@1'``).

    Returns:
        The rewritten name (``name`` itself when MLflow accepts it).
    """
    out = _BAD_CHARS.sub(lambda m: m.group(0) if m.group(0) in keep else ("_at_" if m.group(0) == "@" else "_"),
                         str(name))
    if out == "" or posixpath.normpath(out) != out or out.startswith("/"):
        out = "/".join({"": "_", ".": "_", "..": "__"}.get(part, part) for part in out.split("/"))
    if len(out) > MLFLOW_MAX_NAME:
        out = f"{out[:MLFLOW_MAX_NAME - 9]}.{name_hash(str(name))}"
    return out


def metric_names(metrics: dict) -> dict:
    """``metrics`` with every key through :func:`metric_name` (a reader of files written with verl's ``@``)."""
    return {metric_name(k): v for k, v in metrics.items()}
