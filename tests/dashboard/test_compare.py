"""``trajflow compare``: the printed table against the MLflow store, the PNG, run naming, bad input.

Expected values are read straight from MLflow with ``MlflowClient`` (or logged by hand in a scratch
store) and reduced here with plain Python/numpy, never through ``trajflow.compare``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

TRAJFLOW = str(Path(sys.executable).parent / "trajflow")
BLUE, ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # tab10: first and second run


def cli(*args, env=None, timeout=240):
    e = dict(os.environ, COLUMNS="320")
    e.update(env or {})
    p = subprocess.run([TRAJFLOW, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=e)
    return p.returncode, p.stdout, p.stderr


def parse_table(out: str) -> tuple[list[str], dict[str, list[str]]]:
    """Rich table text -> (run headers, {row label: cells}). Rows are '│ label │ a │ b │'."""
    header = next(line for line in out.splitlines() if line.startswith("┃"))
    runs = [c.strip() for c in header.strip("┃").split("┃")][1:]
    rows = {}
    for line in out.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip().strip("│").split("│")]
            rows[cells[0]] = cells[1:]
    return runs, rows


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def seconds(text: str) -> float:
    """'42.1s' | '3m 07s' | '2h 05m' -> seconds."""
    m = re.fullmatch(r"(?:(\d+)h )?(?:(\d+)m ?)?(?:([\d.]+)s)?", text)
    assert m, text
    h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    return 3600 * h + 60 * mi + s


def color_pixels(png: Path, rgb: tuple[int, int, int], tol: int = 12) -> int:
    import matplotlib.image as mpimg

    img = (mpimg.imread(png)[..., :3] * 255).round().astype(int)
    return int((np.abs(img - np.array(rgb)).max(axis=-1) <= tol).sum())


def test_compare_two_runs_table_matches_mlflow(two_runs, tmp_path):
    from mlflow.tracking import MlflowClient

    t0 = time.perf_counter()
    rc, out, err = cli("compare", *two_runs.names, "--store", two_runs.root, "--out", tmp_path)
    assert rc == 0, err
    runs, rows = parse_table(out)
    assert runs == two_runs.names

    client = MlflowClient(two_runs.tracking_uri)
    val_keys = sorted({k for n in two_runs.names for k in client.get_run(two_runs.mlflow_ids[n]).data.metrics
                       if k.startswith("val-core/")})
    assert val_keys == ["val-core/reasoning_gym/basic_arithmetic/acc/mean_at_1"]
    for j, name in enumerate(two_runs.names):
        rid = two_runs.mlflow_ids[name]
        info = client.get_run(rid).info
        assert rows["mlflow run id"][j] == rid
        assert rows["status"][j] == "FINISHED"
        assert rows["iterations"][j] == "3/3"
        assert seconds(rows["wall time"][j]) == pytest.approx((info.end_time - info.start_time) / 1000, abs=1.0)
        for key in ["critic/score/mean", "response_length/mean", *val_keys]:
            h = history(client, rid, key)
            steps = [s for s, _ in h]
            values = np.array([v for _, v in h])
            final = values[-1]
            best = values.max()                       # all three are "higher is better"
            best_step = steps[int(np.argmax(values))]  # first step reaching the max
            assert float(rows[f"{key} final"][j]) == pytest.approx(final, rel=1e-5, abs=1e-9), key
            shown_best, shown_step = rows[f"{key} best (max)"][j].split(" @ it ")
            assert float(shown_best) == pytest.approx(best, rel=1e-5, abs=1e-9), key
            assert int(shown_step) == best_step, key
        assert [s for s, _ in history(client, rid, "critic/score/mean")] == [1, 2, 3]
        assert [s for s, _ in history(client, rid, val_keys[0])] == [0, 1, 2, 3]
    # only the differing config keys: the runs differ in actor.lr and trainer.run_id (passed per run)
    assert rows["actor.lr"] == ["0.1", "1e-05"]
    assert "rollout.n" not in rows and "reward.custom_function" not in rows and "model.path" not in rows
    config_rows = [k for k in rows if "." in k and "/" not in k]
    assert set(config_rows) <= {"actor.lr", "trainer.run_id"}, config_rows

    png = tmp_path / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert color_pixels(png, BLUE) > 200 and color_pixels(png, ORANGE) > 200  # one line per run
    data = json.loads((tmp_path / "compare.json").read_text())
    assert [r["name"] for r in data["runs"]] == two_runs.names
    if os.environ.get("TRAJFLOW_WRITE_DOCS_IMG") == "1":
        rc, _, err = cli("compare", *two_runs.names, "--store", two_runs.root, "--out", tmp_path / "docs",
                         "-m", "critic/score/mean", "-m", "actor/entropy", "-m", "actor/grad_norm",
                         "-m", "val-core/*")
        assert rc == 0, err
        dst = Path(__file__).resolve().parents[2] / "docs" / "img" / "compare.png"
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes((tmp_path / "docs" / "compare.png").read_bytes())
    print(f"compare CLI: {time.perf_counter() - t0:.1f}s; training: {two_runs.train_s}")


def test_compare_names_runs_by_mlflow_id_prefix_and_verl_metric(two_runs):
    from trajflow.compare import compare_runs, open_client

    client, uri = open_client(two_runs.root)
    hi, lo = (two_runs.mlflow_ids[n] for n in two_runs.names)
    val = "val-core/reasoning_gym/basic_arithmetic/acc/mean@1"  # verl's name, '@' and all
    cmp = compare_runs(client, [hi, lo[:10]], ["critic/score/*", val], uri)
    assert [r.name for r in cmp.runs] == two_runs.names
    assert cmp.metrics == ["critic/score/max", "critic/score/mean", "critic/score/min",
                           "val-core/reasoning_gym/basic_arithmetic/acc/mean_at_1"]


def test_compare_bad_input_is_one_line_exit_2(two_runs, tmp_path):
    from trajflow.errors import CompareError
    from trajflow.compare import compare_runs, open_client

    rc, _, err = cli("compare", "lr-hihg", "lr-low", "--store", two_runs.root, "--out", tmp_path)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "unknown run 'lr-hihg'" in err and "close matches: lr-high" in err and "Traceback" not in err
    # the same error class, raised in-process (the CLI turns every CompareError into exit 2)
    client, _ = open_client(two_runs.root)
    with pytest.raises(CompareError, match=r"'critic/score/maen'.*did you mean 'critic/score/mean'"):
        compare_runs(client, two_runs.names, ["critic/score/maen"])
    with pytest.raises(CompareError, match="no MLflow store"):
        open_client(tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()


def test_compare_values_by_hand(tmp_path):
    """A scratch store with hand-logged metrics: final, best (max or min), iterations, ambiguity."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from trajflow.errors import CompareError
    from trajflow.compare import compare_runs, open_client

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    e1 = c.create_experiment("trajflow/a", artifact_location=(tmp_path / "art").as_uri())
    e2 = c.create_experiment("trajflow/b", artifact_location=(tmp_path / "art").as_uri())

    def run(exp, name, scores, losses, params, iterations):
        r = c.create_run(exp, run_name=name, tags={"trajflow.run_id": name})
        ms = [Metric("critic/score/mean", v, 1000 + s, s) for s, v in enumerate(scores, start=1)]
        ms += [Metric("actor/pg_loss", v, 1000 + s, s) for s, v in enumerate(losses, start=1)]
        ms += [Metric("timing_s/step", 1.0, 1000 + s, s) for s in range(1, iterations + 1)]
        c.log_batch(r.info.run_id, metrics=ms, params=[Param(k, v) for k, v in params.items()])
        c.set_terminated(r.info.run_id)
        return r.info.run_id

    a = run(e1, "alpha", [0.1, 0.5, 0.3], [1.0, 0.4, 0.6], {"actor.lr": "1e-05", "rollout.n": "4"}, 3)
    b = run(e1, "beta", [0.2, 0.2, 0.25, 0.7], [0.9, 0.8, 0.85, 0.7], {"actor.lr": "3e-06", "rollout.n": "4"}, 4)
    run(e2, "alpha", [0.0], [0.0], {}, 1)  # same name in another experiment

    client, _ = open_client(tracking_uri=uri)
    cmp = compare_runs(client, [a, "beta"], ["critic/score/mean", "actor/pg_loss"])
    sa, sb = cmp.summary["alpha"], cmp.summary["beta"]
    assert (sa["critic/score/mean"].final, sa["critic/score/mean"].best, sa["critic/score/mean"].best_step) == (0.3, 0.5, 2)
    assert (sa["actor/pg_loss"].final, sa["actor/pg_loss"].best, sa["actor/pg_loss"].best_step) == (0.6, 0.4, 2)
    assert sa["actor/pg_loss"].goal == "min"
    assert (sb["critic/score/mean"].final, sb["critic/score/mean"].best, sb["critic/score/mean"].best_step) == (0.7, 0.7, 4)
    assert sb["critic/score/mean"].best_step == 4 and sb["actor/pg_loss"].best == 0.7
    assert cmp.iterations == {"alpha": 3, "beta": 4}
    assert cmp.config_diff == [("actor.lr", ["1e-05", "3e-06"])]
    with pytest.raises(CompareError, match="ambiguous") as e:
        compare_runs(client, ["alpha"])
    assert a in str(e.value)
    with pytest.raises(CompareError, match="named twice"):
        compare_runs(client, [a, a[:8]])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(os.environ.get("TRAJFLOW_TEST_MLFLOW_SERVER") != "1",
                    reason="starts an MLflow server (30-90 s on 2 cores); set TRAJFLOW_TEST_MLFLOW_SERVER=1")
def test_compare_from_remote_tracking_server(two_runs, tmp_path):
    port = _free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
                               two_runs.tracking_uri, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        import urllib.request

        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline and server.poll() is None, "mlflow server did not start"
                time.sleep(1)
        rc, out, err = cli("compare", *two_runs.names, "--tracking-uri", f"http://127.0.0.1:{port}",
                           "--out", tmp_path)
        assert rc == 0, err
        runs, rows = parse_table(out)
        assert runs == two_runs.names and rows["actor.lr"] == ["0.1", "1e-05"]
        assert rows["mlflow run id"] == [two_runs.mlflow_ids[n] for n in two_runs.names]
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
