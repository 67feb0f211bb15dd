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


ONE_IT, STEP0 = "one-it", "at-step-0"  # the extra runs of ``extra_runs``


@pytest.fixture(scope="module")
def extra_runs(two_runs):
    """Two more runs in the same store, removed afterwards: ``one-it`` (the first iteration of ``lr-high``
    alone: its folder without iterations 2-3, an MLflow run with its metrics up to step 1) and, newest,
    ``at-step-0`` (a run still validating: a folder with only its config, an MLflow run with only step 0)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(two_runs.tracking_uri)
    src_id = two_runs.mlflow_ids["lr-high"]
    src = client.get_run(src_id)
    made = []
    for name in (ONE_IT, STEP0):  # leftovers of an interrupted session with a reused store
        shutil.rmtree(two_runs.root / name, ignore_errors=True)
        for r in client.search_runs([src.info.experiment_id], filter_string=f"attributes.run_name = '{name}'"):
            client.delete_run(r.info.run_id)
    shutil.copytree(two_runs.root / "lr-high", two_runs.root / ONE_IT,
                    ignore=lambda d, names: [n for n in names if n in ("000002", "000003", "checkpoints", "audit.lance")])
    # the copy is its own trajflow run: the dashboard names runs by their trajflow.run_id tag
    tags = {**{k: v for k, v in src.data.tags.items() if not k.startswith("mlflow.")}, "trajflow.run_id": ONE_IT}
    one = client.create_run(src.info.experiment_id, run_name=ONE_IT, tags=tags)
    for key in src.data.metrics:
        hist = [m for m in client.get_metric_history(src_id, key) if m.step <= 1]
        for m in hist:
            client.log_metric(one.info.run_id, key, m.value, step=m.step, timestamp=m.timestamp)
    client.set_terminated(one.info.run_id)
    made.append(one.info.run_id)
    time.sleep(0.05)
    (two_runs.root / STEP0).mkdir()
    shutil.copy(two_runs.root / "lr-high" / "config.yaml", two_runs.root / STEP0 / "config.yaml")
    zero = client.create_run(src.info.experiment_id, run_name=STEP0, tags={"trajflow.kind": "train"})
    client.log_metric(zero.info.run_id, METRICS[-1], 0.0, step=0)
    made.append(zero.info.run_id)
    now = time.time()
    os.utime(two_runs.root / ONE_IT, (now - 1, now - 1))  # copytree kept lr-high's folder time
    os.utime(two_runs.root / STEP0, (now, now))
    yield {ONE_IT: one.info.run_id, STEP0: zero.info.run_id}
    for rid in made:
        client.delete_run(rid)
    for name in (ONE_IT, STEP0):
        shutil.rmtree(two_runs.root / name, ignore_errors=True)


@pytest.fixture(scope="module")
def dashboard(two_runs, extra_runs, tmp_path_factory):
    """A running ``streamlit run dashboards/app.py`` over the two runs (and ``extra_runs``); yields its base URL."""
    from trajflow.dashboards.data import streamlit_command

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


# ----------------------------------------------------------------------------------------- issue 38 item 11

def _chart_geometry(pg) -> list[dict]:
    """Per chart: title, y-axis tick labels, the plot area's edges (its background), and each point's centre
    and size."""
    return pg.eval_on_selector_all(
        '[data-testid="stVegaLiteChart"]',
        """els => els.map(e => {
             const axes = Array.from(e.querySelectorAll('[aria-roledescription="axis"]'));
             const yAxis = axes.find(a => (a.getAttribute('aria-label') || '').startsWith('Y-axis'));
             const plot = e.querySelector('.role-frame.root > g > path.background').getBoundingClientRect();
             return {
               title: e.querySelector('[aria-roledescription="title"]')?.getAttribute('aria-label') || '',
               yLabels: Array.from(yAxis.querySelectorAll('.role-axis-label text')).map(t => t.textContent),
               xLeft: plot.left, xRight: plot.right, yTop: plot.top, yBottom: plot.bottom,
               points: Array.from(e.querySelectorAll('[aria-roledescription="point"]')).map(p => {
                 const b = p.getBoundingClientRect();
                 return {label: p.getAttribute('aria-label'), cx: b.left + b.width / 2, w: b.width,
                         cy: b.top + b.height / 2, h: b.height};
               })};
           })""")


def test_single_iteration_run_plots_whole_points_on_a_readable_axis(two_runs, dashboard, page, tmp_path):
    # one point per training metric (iteration 1), two per validation metric (iterations 0 and 1)
    metrics = ["critic/score/mean", "actor/entropy", METRICS[-1]]
    page.goto(f"{dashboard}/?runs={ONE_IT}&metrics={','.join(metrics)}")
    page.wait_for_function(
        "n => Array.from(document.querySelectorAll('[data-testid=\"stVegaLiteChart\"]'))"
        ".filter(e => e.querySelectorAll('[aria-roledescription=\"point\"]').length > 0).length >= n", arg=len(metrics))
    charts = _chart_geometry(page)
    assert len(charts) == len(metrics)
    for c in charts:
        steps = [0, 1] if METRICS[-1] in c["title"] else [1]
        labels = sorted({p["label"] for p in c["points"]})
        assert [int(re.match(r"iteration: (\d+);", x).group(1)) for x in labels] == steps, c
        assert all(re.fullmatch(rf"iteration: \d; value: \S+; run: {ONE_IT}", x) for x in labels), c
        for p in c["points"]:  # each point whole inside the plot, away from its edges (not half clipped)
            assert c["xLeft"] + p["w"] < p["cx"] < c["xRight"] - p["w"], c
            assert c["yTop"] + p["h"] < p["cy"] < c["yBottom"] - p["h"], c
        # an axis with ticks around the values, not one value alone at full precision ('0.318750')
        assert len(c["yLabels"]) >= 2, c
        assert not any(re.fullmatch(r"-?\d+\.\d{4,}", t) for t in c["yLabels"]), c


def test_default_run_selection_skips_a_run_still_at_step_0(two_runs, dashboard, page):
    from playwright.sync_api import expect

    page.goto(dashboard + "/")
    page.get_by_text("Final and best values").wait_for()
    chips = page.locator('[data-testid="stMultiSelect"]').first.locator("[data-tag]")
    # newest first: at-step-0 (no finished iteration: skipped), one-it, lr-low. The chips render after the
    # table below them on a loaded machine, so wait for them before reading their labels.
    expect(chips).to_have_count(2, timeout=TIMEOUT_MS)
    assert [chips.nth(i).get_attribute("aria-label") for i in range(chips.count())] == [ONE_IT, "lr-low"]
    page.goto(dashboard + "/trajectories")
    page.get_by_text(re.compile(r"^\d+ rows? ·")).wait_for()
    # one-it's 4 rows (2 prompts x 2 samples), not at-step-0's "no stored rollouts yet"
    assert page.get_by_text(re.compile(r"^\d+ rows? ·")).inner_text().startswith("4 rows ·")


def test_one_iteration_keeps_the_iterations_filter(two_runs, dashboard, page):
    page.goto(f"{dashboard}/trajectories?run={ONE_IT}")
    page.get_by_text(re.compile(r"^4 rows ·")).wait_for()  # 2 prompts x 2 samples
    assert page.locator(".st-key-traj_its_one").inner_text().split() == ["Iterations", "1", "(the", "only", "stored",
                                                                         "iteration)"]


def test_runs_page_links_mlflow_and_prefect_and_plots_the_all_equal_share(two_runs, dashboard, page):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(two_runs.tracking_uri)
    page.goto(f"{dashboard}/?runs={','.join(two_runs.names)}")  # default metrics
    page.get_by_text("Final and best values").wait_for()
    for name in two_runs.names:
        r = client.get_run(two_runs.mlflow_ids[name])
        mlflow_href = page.get_by_role("link", name="MLflow run").nth(two_runs.names.index(name)).get_attribute("href")
        assert mlflow_href == f"http://127.0.0.1:5000/#/experiments/{r.info.experiment_id}/runs/{r.info.run_id}"
        prefect_href = page.get_by_role("link", name="Prefect flow run").nth(two_runs.names.index(name)).get_attribute("href")
        assert prefect_href == f"http://127.0.0.1:4200/runs/flow-run/{r.data.tags['prefect.flow_run_id']}"
    page.wait_for_function(
        "() => Array.from(document.querySelectorAll('[data-testid=\"stVegaLiteChart\"] [aria-roledescription=\"title\"]'))"
        ".some(t => (t.getAttribute('aria-label') || '').includes('groups/all_equal_share'))")
    plotted = _points(page)["groups/all_equal_share"]
    for name in two_runs.names:  # by hand: per iteration, groups whose scores are all equal / groups
        want = {}
        for d in sorted((two_runs.root / name / "iterations").iterdir()):
            gid = {r["sample_id"]: r["group_id"] for r in pq.read_table(d / "rollout.parquet").to_pylist()}
            groups: dict = {}
            for r in pq.read_table(d / "reward.parquet").to_pylist():
                groups.setdefault(gid[r["sample_id"]], []).append(r["score"])
            want[int(d.name)] = sum(len(set(v)) == 1 for v in groups.values()) / len(groups)
        assert plotted[name] == pytest.approx(want), name


def test_token_view_histograms_and_prompt_across_iterations(two_runs, dashboard, page, tmp_path):
    from playwright.sync_api import expect

    run = two_runs.names[0]
    d = two_runs.root / run / "iterations" / "000002"
    ro = {r["sample_id"]: r for r in pq.read_table(d / "rollout.parquet").to_pylist()}
    adv = {r["sample_id"]: r["advantages"] for r in pq.read_table(d / "advantage.parquet").to_pylist()}
    sid = max(ro, key=lambda s: len(ro[s]["response_ids"]))
    n = len(ro[sid]["response_ids"])
    page.goto(f"{dashboard}/trajectories?run={run}")
    page.get_by_text(re.compile(r"^\d+ rows? ·")).wait_for()
    page.locator(f".st-key-card_{sid}").get_by_text("tokens", exact=True).click()
    spans = page.locator(f".st-key-tokens_{sid} .tf-token")
    expect(spans).to_have_count(n, timeout=TIMEOUT_MS)
    got = spans.evaluate_all("els => els.map(e => [e.dataset.advantages, e.dataset.rolloutLogprobs, "
                             "e.dataset.lossMask, e.style.backgroundColor])")
    for (a, lp, mask, bg), want_a, want_lp in zip(got, adv[sid], ro[sid]["rollout_logprobs"]):
        assert float(a) == pytest.approx(want_a, abs=0) and float(lp) == pytest.approx(want_lp, abs=0)
        assert mask in ("0", "1")
        assert bg.startswith("rgba(0, 160, 60" if want_a > 0 else "rgba(220, 40, 40" if want_a < 0 else "rgba(128, 128, 128")
    shot = tmp_path / "dashboard-tokens.png"  # the card alone: the rest of the page is the trajectories shot
    page.locator(f".st-key-card_{sid}").screenshot(path=str(shot))
    if os.environ.get("TRAJFLOW_WRITE_DOCS_IMG") == "1":
        shutil.copy(shot, DOCS_IMG / shot.name)

    page.get_by_text("Score and response-length histograms per iteration").click()
    hist = page.locator(".st-key-hist_response_length .mark-rect.role-mark path[aria-label]")
    hist.first.wait_for()
    per_it: dict = {}
    for label in hist.evaluate_all("els => els.map(e => e.getAttribute('aria-label'))"):
        it = int(re.search(r"iteration: (\d+)", label).group(1))
        per_it[it] = per_it.get(it, 0) + int(re.search(r"responses: (\d+)", label).group(1))
    assert per_it == {1: 4, 2: 4, 3: 4}  # every response of each iteration counted in one bin

    group = ro[sid]["group_id"]
    page.goto(f"{dashboard}/trajectories?run={run}&view=prompt&prompt={ro[sid]['prompt_id']}")
    page.get_by_text(f"prompt {ro[sid]['prompt_id']}: 1 group in iterations 2").wait_for()
    expect(page.locator(f".st-key-group_2_{group} [class*='st-key-gresponse_']")).to_have_count(2, timeout=TIMEOUT_MS)
