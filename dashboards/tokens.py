"""The per-token view of one stored response: each token with the numbers RL is debugged with.

A response's row is spread over its iteration's stage files (``rollout.parquet``: the token ids, the
behaviour log-probs and, for multi-turn rows, the loss mask; ``reward.parquet``: token rewards and
the reference / teacher log-probs when the run computed them; ``advantage.parquet``: advantages,
returns and values) and the gate's quarantine (``gate.json``). :func:`token_rows` joins them token
by token; :func:`token_html` renders them as colour-coded spans. No Streamlit here.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

import pyarrow.compute as pc

from trajflow.dashboards.data import _read_parquet, _stage_file, _store
from trajflow.errors import DashboardError

#: Per-token columns read from each stage file when present (stage -> columns), in display order.
TOKEN_COLUMNS = {
    "rollout": ("rollout_logprobs", "loss_mask", "token_entropy"),
    "reward": ("token_rewards", "ref_logprobs", "teacher_logprobs"),
    "advantage": ("advantages", "returns", "values"),
}
#: What :func:`token_html` can colour by.
COLOR_KEYS = ("advantages", "rollout_logprobs", "token_entropy", "teacher_logprobs")


def run_tokenizer(store_root: str | Path, run_id: str):
    """The tokenizer of the run's model (``model.path`` of its stored ``config.yaml``), or None.

    Only tokenizer files are read (``trust_remote_code`` stays off and nothing is downloaded): a
    stored config names no code. A built-in model name reads the tokenizer-only copy in the model
    cache. None when the config or the tokenizer cannot be read; the view then shows token ids.
    """
    import yaml

    store = _store(store_root, run_id)
    try:
        cfg = yaml.safe_load((store.run_dir / "config.yaml").read_text()) or {}
        path = str(((cfg.get("model") or {}).get("path")) or "")
    except (OSError, ValueError, yaml.YAMLError):
        return None
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        from trajflow.models import BUILTIN_MODELS, builtin_tokenizer_dir

        where = builtin_tokenizer_dir(path) if path in BUILTIN_MODELS else Path(path).expanduser()
        if not (Path(where) / "tokenizer_config.json").exists():
            return None
        return AutoTokenizer.from_pretrained(str(where), local_files_only=True, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - any unreadable tokenizer means "show ids", never a broken page
        return None


def _row(store, it: int, stage: str, sample_id: str, columns: tuple[str, ...]) -> dict:
    import pyarrow.parquet as pq

    path = _stage_file(store, it, stage)
    if path is None:
        return {}
    names = set(pq.read_schema(path).names)
    cols = ["sample_id"] + [c for c in columns if c in names]
    t = _read_parquet(path, cols)
    t = t.filter(pc.equal(t.column("sample_id"), sample_id))
    return t.to_pylist()[0] if t.num_rows else {}


def token_rows(store_root: str | Path, run_id: str, iteration: int, sample_id: str, tokenizer=None) -> dict:
    """One stored response token by token.

    Args:
        store_root: the store root.
        run_id: the trajflow run id.
        iteration: the response's iteration.
        sample_id: the response's ``sample_id``.
        tokenizer: decodes each token id to its text (None: the text is ``<id>``).

    Returns:
        ``{"tokens": [...], "columns": [...], "quarantined": bool}``: one dict per response token with
        ``index``, ``token_id``, ``text`` and each stored per-token column (``rollout_logprobs``: the
        behaviour policy's log-prob, float; ``advantages``; ``token_rewards``; ``ref_logprobs`` /
        ``teacher_logprobs`` / ``returns`` / ``values`` / ``token_entropy`` when stored), plus
        ``loss_mask`` (int 0/1: the rollout's mask, all ones for single-turn rows, times the gate's
        quarantine of the row). ``columns`` names the per-token columns the run stored. A column
        shorter than the response (greedy rows store no log-probs) gives None on the missing tokens.

    Raises:
        DashboardError: unknown run, or no such response in the iteration's rollout.
    """
    store = _store(store_root, run_id)
    it = int(iteration)
    ro = _row(store, it, "rollout", sample_id, ("response_ids",) + TOKEN_COLUMNS["rollout"])
    if not ro:
        raise DashboardError(f"run {run_id!r} iteration {it}: no response {sample_id!r} in its rollout.parquet")
    merged = dict(ro)
    for stage in ("reward", "advantage"):
        merged.update({k: v for k, v in _row(store, it, stage, sample_id, TOKEN_COLUMNS[stage]).items()
                       if k != "sample_id"})
    gate = store.read_iteration_json(it, "gate.json") or {}
    quarantined = sample_id in set(gate.get("quarantined_sample_ids") or [])
    ids = list(merged.get("response_ids") or [])
    columns = [c for cols in TOKEN_COLUMNS.values() for c in cols if c != "loss_mask" and merged.get(c)]
    mask = list(merged.get("loss_mask") or [1] * len(ids))
    tokens = []
    for i, tid in enumerate(ids):
        text = tokenizer.decode([tid]) if tokenizer is not None else f"<{tid}>"
        tok = {"index": i, "token_id": int(tid), "text": text,
               "loss_mask": 0 if quarantined else int(mask[i] if i < len(mask) else 1)}
        for c in columns:
            vals = merged[c]
            tok[c] = float(vals[i]) if i < len(vals) and vals[i] is not None else None
        tokens.append(tok)
    return {"tokens": tokens, "columns": columns, "quarantined": quarantined}


def _rgba(value: float | None, key: str, scale: float) -> str:
    """Background colour of one token: advantages diverge (green > 0, red < 0, alpha by |value| / scale);
    log-probs shade red by improbability (1 - p); entropy shades blue by value / scale."""
    if value is None or not math.isfinite(value):
        return "transparent"
    if key in ("advantages", "returns", "token_rewards"):
        a = min(abs(value) / scale, 1.0) if scale > 0 else 0.0
        return f"rgba(0,160,60,{0.1 + 0.6 * a:.3f})" if value > 0 else (
            f"rgba(220,40,40,{0.1 + 0.6 * a:.3f})" if value < 0 else "rgba(128,128,128,0.12)")
    if key.endswith("logprobs"):
        return f"rgba(220,40,40,{0.05 + 0.7 * (1.0 - math.exp(min(value, 0.0))):.3f})"
    a = min(value / scale, 1.0) if scale > 0 else 0.0
    return f"rgba(40,90,220,{0.05 + 0.6 * a:.3f})"


def token_html(view: dict, color_by: str = "advantages") -> str:
    """The tokens as HTML spans, colour-coded by one column (see :func:`_rgba`), loss-masked tokens
    struck through in grey. Each span carries its numbers in ``data-*`` attributes and a tooltip.

    Raises:
        DashboardError: ``color_by`` is not one of :data:`COLOR_KEYS`.
    """
    if color_by not in COLOR_KEYS:
        raise DashboardError(f"color_by={color_by!r}: choose one of {', '.join(COLOR_KEYS)}")
    vals = [t.get(color_by) for t in view["tokens"]]
    finite = [abs(v) for v in vals if v is not None and math.isfinite(v)]
    scale = max(finite) if finite else 0.0
    spans = []
    for t in view["tokens"]:
        nums = {c: t.get(c) for c in view["columns"]}
        tip = " · ".join([f"#{t['index']} id {t['token_id']}", f"loss mask {t['loss_mask']}"]
                         + [f"{c} {v:.4g}" for c, v in nums.items() if v is not None])
        data = " ".join(f'data-{c.replace("_", "-")}="{v!r}"' for c, v in nums.items() if v is not None)
        style = f"background:{_rgba(t.get(color_by), color_by, scale)};white-space:pre-wrap;" \
                "border-right:1px solid rgba(0,0,0,0.15);font-family:monospace"
        if not t["loss_mask"]:
            style += ";color:#888;text-decoration:line-through"
        spans.append(f'<span class="tf-token" data-index="{t["index"]}" data-loss-mask="{t["loss_mask"]}" {data} '
                     f'title="{html.escape(tip)}" style="{style}">{html.escape(t["text"]) or "&#8203;"}</span>')
    return '<div class="tf-tokens" style="line-height:1.9">' + "".join(spans) + "</div>"
