"""The dashboard in a real headless Chromium (Debian's ``/usr/bin/chromium``, driven by Playwright).

Streamlit runs as a subprocess on a free loopback port over the two runs of ``two_runs``. The
runs page must plot every (iteration, value) point MLflow holds for both runs; a full-text search
in the trajectory browser must return exactly the stored response that contains a word chosen here
from the run's Parquet files; the gates page must list each iteration's gate result. Screenshots of
the pages go to the test's tmp folder, and to ``docs/img/`` with ``TRAJFLOW_WRITE_DOCS_IMG=1``.

Needs ``apt-get install -y chromium`` (never ``playwright install``: no browser download at run time).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

CHROMIUM = os.environ.get("TRAJFLOW_TEST_CHROMIUM", "/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason=f"{CHROMIUM} is missing: sudo apt-get install -y chromium "
                                       "(make test installs it when run as root)")
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parents[2]
DOCS_IMG = REPO / "docs" / "img"
METRICS = ["critic/score/mean", "actor/entropy", "actor/grad_norm", "val-core/reasoning_gym/basic_arithmetic/acc/mean_at_1"]
TIMEOUT_MS = 90_000  # first page load imports MLflow inside Streamlit: slow on 2 busy cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dashboard(two_runs, tmp_path_factory):
    """A running ``streamlit run dashboards/app.py`` over the two runs; yields its base URL."""
    from dashboards.data import streamlit_command

    port = _free_port()
    log = tmp_path_factory.mktemp("streamlit") / "streamlit.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    with open(log, "wb") as out:
        proc = subprocess.Popen(streamlit_command(two_runs.root, port=port), stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                if urllib.request.urlopen(base + "/_stcore/health", timeout=2).read().strip() == b"ok":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"streamlit did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def page(dashboard):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.set_default_timeout(TIMEOUT_MS)
        yield pg
        browser.close()


def _save(pg, name: str, tmp_path: Path) -> Path:
    """Screenshot the whole page: Streamlit scrolls inside its main block, so grow the viewport first."""
    shot = tmp_path / name
    size = pg.viewport_size
    height = pg.evaluate("() => document.querySelector('[data-testid=\"stMainBlockContainer\"]').scrollHeight")
    pg.set_viewport_size({"width": size["width"], "height": max(size["height"], min(int(height) + 120, 4000))})
    pg.wait_for_timeout(500)
    pg.screenshot(path=str(shot))
    pg.set_viewport_size(size)
    assert shot.stat().st_size > 10_000
    if os.environ.get("TRAJFLOW_WRITE_DOCS_IMG") == "1":
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, DOCS_IMG / name)
    return shot


def _points(pg) -> dict[str, dict[str, dict[int, float]]]:
    """Every plotted point, read from the charts' SVG: metric -> run -> {iteration: value}."""
    charts = pg.eval_on_selector_all(
        '[data-testid="stVegaLiteChart"]',
        """els => els.map(e => ({
             title: e.querySelector('[aria-roledescription="title"]')?.getAttribute('aria-label') || '',
             points: Array.from(e.querySelectorAll('[aria-roledescription="point"]')).map(p => p.getAttribute('aria-label')),
             strokes: Array.from(e.querySelectorAll('[aria-roledescription="line mark"]')).map(p => p.getAttribute('stroke'))
           }))""")
    out: dict = {}
    for c in charts:
        metric = re.search(r"Title text '(.+)'", c["title"]).group(1)
        assert sorted(c["strokes"]) == ["#1f77b4", "#ff7f0e"], (metric, c["strokes"])  # one line per run
        for label in c["points"]:
            m = re.fullmatch(r"iteration: (\d+); value: (\S+); run: (\S+)", label)
            assert m, label
            out.setdefault(metric, {}).setdefault(m.group(3), {})[int(m.group(1))] = float(m.group(2))
    return out


def test_runs_page_shows_curves_of_two_runs(two_runs, dashboard, page, tmp_path):
    from mlflow.tracking import MlflowClient

    t0 = time.perf_counter()
    page.goto(f"{dashboard}/?runs={','.join(two_runs.names)}&metrics={','.join(METRICS)}")
    page.wait_for_function(
        "n => Array.from(document.querySelectorAll('[data-testid=\"stVegaLiteChart\"]'))"
        ".filter(e => e.querySelectorAll('[aria-roledescription=\"point\"]').length > 0).length >= n",
        arg=len(METRICS))
    page.get_by_text("Final and best values").wait_for()
    plotted = _points(page)

    client = MlflowClient(two_runs.tracking_uri)
    assert sorted(plotted) == sorted(METRICS)
    for metric in METRICS:
        assert sorted(plotted[metric]) == sorted(two_runs.names), metric
        for name in two_runs.names:
            stored = {m.step: m.value for m in client.get_metric_history(two_runs.mlflow_ids[name], metric)}
            assert sorted(plotted[metric][name]) == sorted(stored), (metric, name)
            assert sorted(stored) == ([0, 1, 2, 3] if metric.startswith("val-core/") else [1, 2, 3])
            for step, value in stored.items():
                assert plotted[metric][name][step] == pytest.approx(value, rel=1e-8, abs=1e-12), (metric, name, step)
    # the two learning rates must give different curves (else the page could show one run twice)
    assert plotted["actor/entropy"]["lr-high"] != plotted["actor/entropy"]["lr-low"]
    table = page.locator('[data-testid="stTable"]').first.inner_text()
    assert all(n in table for n in two_runs.names)
    _save(page, "dashboard-runs.png", tmp_path)
    print(f"runs page: {time.perf_counter() - t0:.1f}s")


def _pick_search_word(run_dir: Path) -> tuple[str, dict]:
    """A word that occurs in exactly one stored response and (by its first 5 letters) nowhere else.

    Returns:
        ``(word, row)`` where row has the response's sample_id, response_text, score, policy_version.
    """
    rows = []
    for it_dir in sorted((run_dir / "iterations").iterdir()):
        ro = pq.read_table(it_dir / "rollout.parquet").to_pylist()
        sc = {r["sample_id"]: r["score"] for r in pq.read_table(it_dir / "reward.parquet").to_pylist()}
        rows += [dict(r, score=sc[r["sample_id"]]) for r in ro]
    corpus = [(r["response_text"] or "").lower() for r in rows]
    prompts = " ".join(m["content"].lower() for r in rows for m in r["prompt"])
    for i, r in enumerate(rows):
        for word in sorted(set(re.findall(r"[A-Za-z]{6,}", r["response_text"] or ""))):
            stem = word.lower()[:5]
            if stem in prompts or any(stem in c for j, c in enumerate(corpus) if j != i):
                continue
            if len(re.findall(rf"\b{re.escape(word.lower())}\b", corpus[i])) == 1:
                return word, r
    pytest.fail("no response holds a distinctive word to search for")


def test_trajectory_search_returns_the_stored_response(two_runs, dashboard, page, tmp_path):
    t0 = time.perf_counter()
    run = two_runs.names[0]
    word, expected = _pick_search_word(two_runs.root / run)
    page.goto(f"{dashboard}/trajectories?run={run}")
    count = page.get_by_text(re.compile(r"^\d+ rows? ·"))
    count.wait_for()
    total = int(re.match(r"(\d+) rows?", count.inner_text()).group(1))
    assert total == 12  # 3 iterations x 2 prompts x 2 samples
    box = page.get_by_label("Search prompts and responses")
    box.fill(word)
    box.press("Enter")
    from playwright.sync_api import expect

    page.get_by_text(re.compile(r"^1 row ·")).wait_for()
    responses = page.locator('[class*="st-key-response_"]')
    # cards of the previous script run stay in the DOM until the rerun finishes: wait for them to go
    expect(responses).to_have_count(1, timeout=TIMEOUT_MS)
    assert responses.first.inner_text().strip() == expected["response_text"].strip()
    card = page.locator(f'.st-key-card_{expected["sample_id"]}').inner_text()
    assert expected["sample_id"] in card
    assert f"score {format(expected['score'], '.4g')}" in card
    assert f"policy v{expected['policy_version']}" in card
    _save(page, "dashboard-trajectories.png", tmp_path)
    print(f"trajectory search for {word!r}: {time.perf_counter() - t0:.1f}s")


def test_gates_page_lists_each_iteration(two_runs, dashboard, page, tmp_path):
    run = two_runs.names[0]
    gate = [json.loads((two_runs.root / run / "iterations" / f"{i:06d}" / "gate.json").read_text()) for i in (1, 2, 3)]
    page.goto(f"{dashboard}/gates?run={run}")
    page.get_by_text("3 iterations gated").wait_for()
    rows = page.locator('[data-testid="stTable"]').first.evaluate(
        "t => Array.from(t.querySelectorAll('tr')).map(tr => Array.from(tr.querySelectorAll('th,td')).map(c => c.innerText.trim()))")
    assert rows[0][:3] == ["iteration", "result", "quarantined"]
    body = rows[1:]
    assert [int(r[0]) for r in body] == [1, 2, 3]
    assert [r[1].strip() for r in body] == ["pass" if g["success"] else "FAIL" for g in gate]
    assert [int(r[2]) for r in body] == [len(g["quarantined_sample_ids"]) for g in gate]
    _save(page, "dashboard-gates.png", tmp_path)


def test_group_view_shows_each_prompt_once_with_its_responses(two_runs, dashboard, page, tmp_path):
    from playwright.sync_api import expect

    run = two_runs.names[0]
    it_dir = two_runs.root / run / "iterations" / "000001"
    ro = pq.read_table(it_dir / "rollout.parquet").to_pylist()
    scores = {r["sample_id"]: r["score"] for r in pq.read_table(it_dir / "reward.parquet").to_pylist()}
    group = ro[0]["group_id"]
    members = sorted(r["sample_id"] for r in ro if r["group_id"] == group)
    page.goto(f"{dashboard}/trajectories?run={run}")
    page.get_by_text(re.compile(r"^\d+ rows? ·")).wait_for()
    page.get_by_text("groups", exact=True).click()
    page.get_by_text(re.compile(r"^6 groups ·")).wait_for()  # 3 iterations x 2 prompts
    card = page.locator(f".st-key-group_1_{group}")
    expect(card.locator('[class*="st-key-gresponse_"]')).to_have_count(len(members), timeout=TIMEOUT_MS)
    text = card.inner_text()
    user_turns = sum(m["role"] == "user" for m in ro[0]["prompt"])
    assert text.count("user:") == user_turns  # the prompt once, not once per response
    for sid in members:
        assert f"score {format(scores[sid], '.4g')}" in text
    _save(page, "dashboard-groups.png", tmp_path)
