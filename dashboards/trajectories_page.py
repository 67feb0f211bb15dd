"""Trajectory browser: a run's stored responses, filtered, searched and sorted; one card per response,
or one card per group (a prompt once, its n responses side by side)."""

from __future__ import annotations

import json
from urllib.parse import quote

import streamlit as st

from trajflow.dashboards.common import run_picker, settings
from trajflow.dashboards.data import (SORT_KEYS, TrajectoryFilter, episode_messages, find_groups, find_trajectories,
                             trajectory_facets, trajectory_source)
from trajflow.dashboards.iteration_stats import iteration_distributions, prompt_history, repeated_prompts
from trajflow.dashboards.tokens import COLOR_KEYS, run_tokenizer, token_html, token_rows


@st.cache_data(ttl=15, show_spinner=False)
def _facets(root: str, run: str) -> dict:
    return trajectory_facets(root, run)


@st.cache_data(ttl=15, show_spinner="searching ...")
def _find(root: str, run: str, flt: TrajectoryFilter, limit: int) -> list[dict]:
    return find_trajectories(root, run, flt, limit).to_pylist()


@st.cache_data(ttl=15, show_spinner="searching ...")
def _groups(root: str, run: str, flt: TrajectoryFilter, limit: int) -> list[dict]:
    return find_groups(root, run, flt, limit)


@st.cache_resource(show_spinner=False)
def _tokenizer(root: str, run: str):
    return run_tokenizer(root, run)


@st.cache_data(ttl=15, show_spinner=False)
def _tokens(root: str, run: str, iteration: int, sample_id: str) -> dict:
    return token_rows(root, run, iteration, sample_id, _tokenizer(root, run))


@st.cache_data(ttl=15, show_spinner=False)
def _distributions(root: str, run: str):
    return iteration_distributions(root, run).to_pandas()


@st.cache_data(ttl=15, show_spinner=False)
def _repeated(root: str, run: str) -> list[tuple[str, int]]:
    return repeated_prompts(root, run)


@st.cache_data(ttl=15, show_spinner="reading the prompt's groups ...")
def _history(root: str, run: str, prompt_id: str) -> list[dict]:
    return prompt_history(root, run, prompt_id)


def _fmt(v, spec: str = ".4g") -> str:
    return "—" if v is None else format(v, spec)


@st.cache_data(ttl=15, show_spinner=False)
def _turns(root: str, run: str, iteration: int, sample_id: str) -> list[dict]:
    return episode_messages(root, run, iteration, sample_id)


def _turn_view(root: str, run: str, row: dict) -> None:
    """A multi-turn episode turn by turn: assistant messages, their tool calls, and tool results
    (errors in red) set apart in their own elements."""
    turns = _turns(root, run, int(row["iteration"]), row["sample_id"])
    if not turns:
        return
    sid = row["sample_id"]
    st.caption(f"{row['num_turns']} turns · finish {row['finish_reason']} · {row.get('tool_calls') or 0} tool calls · "
               f"{row.get('tool_errors') or 0} tool errors")
    for i, m in enumerate(turns):
        role = m["role"]
        with st.chat_message("assistant" if role == "assistant" else "user", avatar=None):
            st.markdown(f"**{role}** · turn {m['turn']}")
            key = f"turn_{sid}_{i}_{role}"
            with st.container(key=key):
                st.code(m["content"], language=None, wrap_lines=True)
            for j, c in enumerate(m.get("calls") or []):
                with st.expander(f"tool call {c['name']}" + (" · error" if c["error"] else ""), expanded=True):
                    with st.container(key=f"toolargs_{sid}_{m['turn']}_{j}"):
                        st.code(c["arguments"] or "", language="json", wrap_lines=True)
                    if c["error"]:
                        with st.container(key=f"toolerror_{sid}_{m['turn']}_{j}"):
                            st.error(c["error"])
                    else:
                        with st.container(key=f"toolresult_{sid}_{m['turn']}_{j}"):
                            st.code(c["result"] or "", language=None, wrap_lines=True)


def _token_view(root: str, run: str, row: dict) -> None:
    """The response token by token, colour-coded, with a table of every stored per-token number."""
    import pandas as pd

    sid = row["sample_id"]
    view = _tokens(root, run, int(row["iteration"]), sid)
    stored = [c for c in COLOR_KEYS if c in view["columns"]]
    if not stored:
        st.caption("no per-token numbers stored for this response")
        return
    by = st.radio("colour by", stored, horizontal=True, key=f"tokcolor_{sid}",
                  format_func=lambda c: {"advantages": "advantage", "rollout_logprobs": "log-prob (behaviour)",
                                         "token_entropy": "entropy", "teacher_logprobs": "log-prob (teacher)"}[c])
    with st.container(key=f"tokens_{sid}"):
        st.html(token_html(view, by))
    notes = ["struck through: loss mask 0" + (" (the gate quarantined this response)" if view["quarantined"] else ""),
             "advantage: green > 0, red < 0", "log-prob: the redder, the less likely"]
    if "token_entropy" not in view["columns"]:
        notes.append("per-token entropy is not stored by this run")
    st.caption(" · ".join(notes))
    with st.expander("per-token table", expanded=False):
        st.dataframe(pd.DataFrame(view["tokens"]), hide_index=True, width="stretch")


def _card(row: dict, root: str | None = None, run: str | None = None) -> None:
    with st.container(border=True, key=f"card_{row['sample_id']}"):
        st.markdown(
            f"**{row['sample_id']}** · iteration {row['iteration']} · `{row['data_source']}` · "
            f"score **{_fmt(row['score'])}** · advantage {_fmt(row['advantage_mean'])} · "
            f"policy v{row['policy_version']} · {row['finish_reason']} · {row['response_length']} tokens"
            + (f" · checkpoint {row['checkpoint_id']}" if row.get("checkpoint_id") else ""))
        left, right = st.columns(2)
        with left:
            st.caption("prompt")
            text = row["prompt_text"] or ""
            st.code(text, language=None, wrap_lines=True, height=180 if text.count("\n") > 6 else "content")
        multi_turn = root is not None and row.get("num_turns") is not None
        with right:
            if multi_turn:  # the turn view below shows the response: once, turn by turn
                st.caption(f"response: {row['num_turns']} turns, below")
            else:
                st.caption("response")
                with st.container(key=f"response_{row['sample_id']}"):
                    st.code(row["response_text"] or "", language=None, wrap_lines=True)
        details = {"ground_truth": row["ground_truth"]}
        try:
            details["reward_extra"] = json.loads(row["reward_extra"]) if row["reward_extra"] else None
        except (TypeError, ValueError):
            details["reward_extra"] = row["reward_extra"]
        if row.get("reward_error"):
            details["reward_error"] = row["reward_error"]
        st.caption("reward details: " + json.dumps(details, default=str))
        if multi_turn:
            _turn_view(root, run, row)
        if root is not None and st.toggle("tokens", key=f"tok_{row['sample_id']}",
                                          help="token, log-prob, advantage, loss mask, colour-coded"):
            _token_view(root, run, row)


def _group_card(group: dict, root: str | None = None, run: str | None = None) -> None:
    """A group: its prompt once and its responses side by side; a multi-turn response turn by turn
    (:func:`_turn_view`, as in the response cards), a single-turn one as its text."""
    rows = group["rows"]
    with st.container(border=True, key=f"group_{group['iteration']}_{group['group_id']}"):
        st.markdown(f"**{group['group_id']}** · iteration {group['iteration']} · `{group['data_source']}` · "
                    f"{len(rows)} responses · score mean **{_fmt(group['score_mean'])}** · "
                    f"std {_fmt(group['score_std'])} · ground truth `{group['ground_truth']}`")
        text = group["prompt_text"] or ""
        st.code(text, language=None, wrap_lines=True, height=150 if text.count("\n") > 5 else "content")
        if run is not None and rows and rows[0].get("prompt_id") is not None:
            st.markdown(f"[this prompt across iterations](./trajectories?run={quote(run)}&prompt="
                        f"{quote(str(rows[0]['prompt_id']))}&view=prompt)")
        per_line = min(len(rows), 4)
        for start in range(0, len(rows), per_line):
            for col, row in zip(st.columns(per_line), rows[start:start + per_line]):
                with col:
                    st.caption(f"{row['sample_id'].rsplit('-', 1)[-1]} · score **{_fmt(row['score'])}** · "
                               f"adv {_fmt(row['advantage_mean'])} · {row['finish_reason']} · "
                               f"{row['response_length']} tok")
                    if root is not None and row.get("num_turns") is not None:
                        with st.container(key=f"gturns_{row['sample_id']}"):
                            _turn_view(root, run, row)
                        continue
                    with st.container(key=f"gresponse_{row['sample_id']}"):
                        st.code(row["response_text"] or "", language=None, wrap_lines=True)


def trajectories_page() -> None:
    cfg = settings()
    st.title("Trajectories")
    run = run_picker(key="traj_run")
    if run is None:
        return
    f = _facets(cfg.store_root, run)
    if not f["iterations"]:
        st.info(f"Run {run} has no stored rollouts yet.")
        return
    c1, c2, c3, c4 = st.columns([2, 2, 2, 1])
    lo, hi = min(f["iterations"]), max(f["iterations"])
    if lo < hi:
        its = c1.slider("Iterations", lo, hi, (lo, hi), key="traj_its")
    else:  # a slider needs two values; say which iteration there is instead of hiding the filter
        with c1.container(key="traj_its_one"):
            st.caption("Iterations")
            st.markdown(f"**{lo}** (the only stored iteration)")
        its = (lo, hi)
    sources = c2.multiselect("Data source", f["data_sources"], key="traj_sources")
    reasons = c3.multiselect("Finish reason", f["finish_reasons"], key="traj_reasons")
    limit = int(c4.number_input("Rows", 1, 1000, 50, step=10, key="traj_limit"))
    score_range = None
    smin, smax = f["score_min"], f["score_max"]
    if smin is not None and smax is not None and smin < smax:
        chosen = st.slider("Score", float(smin), float(smax), (float(smin), float(smax)), key="traj_score")
        if chosen != (float(smin), float(smax)):
            score_range = chosen
    source = trajectory_source(cfg.store_root, run)
    q1, q2, q3, q4 = st.columns([4, 2, 1, 2])
    query = q1.text_input("Search prompts and responses", value=st.query_params.get("q", ""), key="traj_q",
                          placeholder="any part of a word, case-insensitive")
    ranked = source == "audit" and q4.toggle("Ranked full-text", key="traj_fts",
                                             help="BM25 over whole words (audit table); results by relevance")
    sort_by = q2.selectbox("Sort by", SORT_KEYS, key="traj_sort")
    descending = q3.toggle("Desc.", key="traj_desc")
    views = ("responses", "groups", "prompt across iterations")
    asked = {"groups": 1, "prompt": 2}.get(st.query_params.get("view", ""), 0)
    view = st.radio("View", views, index=asked, horizontal=True, key="traj_view")
    grouped = view == "groups"
    text = query.strip() or None
    picked = tuple(s for s in st.query_params.get_all("sample") if s)  # links from the gates page
    if picked:
        st.caption(f"showing the linked response{'s' if len(picked) > 1 else ''}: {', '.join(picked)}")
    flt = TrajectoryFilter(iterations=None if its == (lo, hi) else tuple(its), data_sources=tuple(sources),
                           score_range=score_range, finish_reasons=tuple(reasons), sample_ids=picked,
                           search=None if ranked else text, fulltext=text if ranked else None,
                           sort_by=sort_by, descending=descending)
    where = f" · source: {'LanceDB audit table' if source == 'audit' else 'Parquet stage outputs'}"
    _distribution_charts(cfg.store_root, run)
    if view == views[2]:
        _prompt_across_iterations(cfg.store_root, run)
        return
    if grouped:
        groups = _groups(cfg.store_root, run, flt, limit)
        st.caption(f"{len(groups)} group{'' if len(groups) == 1 else 's'}"
                   + (f" (first {limit})" if len(groups) >= limit else "") + where)
        for group in groups:
            _group_card(group, cfg.store_root, run)
        return
    rows = _find(cfg.store_root, run, flt, limit)
    st.caption(f"{len(rows)} row{'' if len(rows) == 1 else 's'}" + (f" (first {limit})" if len(rows) >= limit else "")
               + where)
    for row in rows:
        _card(row, cfg.store_root, run)


def _distribution_charts(root: str, run: str) -> None:
    """Histograms of the scores and response lengths of each iteration (one column of bins per iteration)."""
    import altair as alt

    with st.expander("Score and response-length histograms per iteration", expanded=False):
        d = _distributions(root, run)
        cols = st.columns(2)
        for col, field, title in ((cols[0], "score", "score"), (cols[1], "response_length", "response length (tokens)")):
            data = d.dropna(subset=[field])
            if data.empty:
                col.caption(f"no {title} stored yet")
                continue
            chart = (alt.Chart(data, title=f"{title} per iteration").mark_rect()
                     .encode(x=alt.X("iteration:O", title="iteration"),
                             y=alt.Y(f"{field}:Q", bin=alt.Bin(maxbins=20), title=title),
                             color=alt.Color("count():Q", scale=alt.Scale(scheme="blues"), title="responses"),
                             tooltip=["iteration:O", alt.Tooltip(f"{field}:Q", bin=alt.Bin(maxbins=20)),
                                      alt.Tooltip("count():Q", title="responses")])
                     .properties(height=260))
            with col.container(key=f"hist_{field}"):
                st.altair_chart(chart, width="stretch")


def _prompt_across_iterations(root: str, run: str) -> None:
    """One prompt's groups in each iteration that sampled it: the same question, the policy's answers over time."""
    repeated = _repeated(root, run)
    wanted = st.query_params.get("prompt")
    options = [p for p, _ in repeated]
    if wanted and wanted not in options:
        options = [wanted] + options
    if not options:
        st.info("No prompt was sampled in more than one iteration of this run (each epoch of a dataset larger than "
                "the run's prompts is new); open one from a group card's link to see it anyway.")
        return
    counts = dict(repeated)
    pid = st.selectbox("Prompt", options, index=options.index(wanted) if wanted in options else 0, key="traj_prompt",
                       format_func=lambda p: f"{p} ({counts.get(p, 1)} iterations)")
    st.query_params["prompt"] = pid
    history = _history(root, run, pid)
    st.caption(f"prompt `{pid}`: {len(history)} group{'' if len(history) == 1 else 's'} in iterations "
               + ", ".join(str(g["iteration"]) for g in history))
    for group in history:
        _group_card(group, root, run)
