"""Share of a default-recipe iteration spent outside model compute, and the run's peak memory.

Runs the default recipe (``flows/configs/grpo_default.yaml``, unchanged except: no validation,
checkpoint only at the end, no progress bar) through the real ``train`` flow (Prefect, Ray, Parquet
store, MLflow on SQLite) for 1 warm-up + K iterations, then accounts for each warm iteration:

* **iteration** = wall time of the whole cycle: from the end of iteration i-1's bookkeeping to the
  end of iteration i's (everything the driver does per iteration: data cursor, five Prefect tasks,
  Ray calls, Parquet writes and hashes, GX gate, MLflow metrics and sample table; checkpoint saves
  excluded and shown separately, amortised over the recipe's ``save_freq``). ``timing_s/step``
  (rollout start to just before logging) is shown too.
* **model compute** = ``timing_s/gen`` + ``timing_s/old_log_prob`` + ``timing_s/update_actor``
  (measured inside the policy worker; plus ``gen_baseline``/``values``/``update_critic`` for recipes
  that have them).
* **outside model compute** = iteration - model compute; target <= 5 % of the iteration.

Its parts are then measured directly, by re-doing each piece in this process on the run's own data
after training (same code paths, median of several repeats), times how often an iteration does it:
reward scoring proper (``trajflow.stages.reward.score_rows``), advantage math (``trajflow.stages.advantage.advantage_table``), the
GX gate (``timing_s/gate`` from the run), Parquet writes + fsync + manifest updates, sha256 of
written/read files, Parquet reads, MLflow ``log_batch``/artifacts, a no-op Prefect task round trip,
no-op Ray actor calls carrying batch-sized payloads and Ray tasks defined per call (as the flow's
tasks do). What is left is printed as unattributed.

Peak memory: a background thread sums RSS over this process and all its descendants (Ray's GCS,
raylet, agents and workers, Prefect's temporary server) every 0.25 s during the run; target <= 5 GiB
(issue 20). Each process is printed by its role (driver, the Ray actor's class, the Ray task worker by
the tasks it ran, Ray's and Prefect's side processes) with its RSS at the peak and its own peak.

    .venv/bin/python benchmarks/overhead.py [--iterations K] [--quick] [key=value ...]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import GIB, RssSampler, header, median, run_trajflow, scratch_dir, verdict

TARGET_SHARE = 0.05
# Seconds measured inside model workers; absent ones count 0 (the default recipe has the first three:
# gen_baseline is ReMax's greedy rollout, values/update_critic belong to PPO with a critic).
MODEL_COMPUTE = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/gen_baseline",
                 "timing_s/values", "timing_s/update_critic")
TARGET_RSS_GIB = 5.0


def timeit(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` (after one warm-up call)."""
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


# --------------------------------------------------------------------------------------------- probes


def probe_store(run_dir: Path, iteration: int, scratch: Path, repeats: int) -> dict[str, float]:
    """Re-do one iteration's store traffic on its own tables in a scratch run store."""
    import pyarrow.parquet as pq

    from trajflow.store import RunStore, sha256_file

    src = RunStore(run_dir.parent, run_dir.name)
    tables = {s: pq.read_table(src.stage_path(iteration, s)) for s in ("rollout", "reward", "advantage")}
    update = src.read_iteration_json(iteration, "update.json") or {}
    gate = src.read_iteration_json(iteration, "gate.json") or {}
    k = [0]

    def fresh() -> RunStore:
        k[0] += 1
        st = RunStore(scratch, f"probe-{k[0]}")
        st.run_dir.mkdir(parents=True)
        return st

    def writes():
        st = fresh()
        refs = {s: st.write_stage(iteration, s, t, 0) for s, t in tables.items()}
        if gate:
            st.write_iteration_json(iteration, "gate.json", gate)
        st.write_iteration_json(iteration, "update.json", update)
        st.mark(iteration, "complete", policy_version_after=1)
        return st, refs

    st, refs = writes()
    paths = [Path(r.path) for r in refs.values()]
    # The tasks' verified reads (read_ref hashes, then reads): reward <- rollout; advantage <- rollout + reward;
    # update <- all three. The gate's two reads are inside timing_s/gate, counted there.
    reads = ["rollout", "rollout", "reward", "rollout", "reward", "advantage"]
    out = {
        "store: Parquet writes + fsync + sha256 + manifest (3 stages, 2 JSON, mark)": timeit(writes, repeats),
        "  of which sha256 of the 3 written files": timeit(lambda: [sha256_file(p) for p in paths], repeats),
        "store: 6 verified reads by reward/advantage/update (sha256 + Parquet read)": timeit(lambda: [st.read_ref(refs[s]) for s in reads], repeats),
        "store: sample-table reads (2, unverified)": timeit(
            lambda: [st.read_stage(iteration, s, verify=False) for s in ("rollout", "reward")], repeats),
    }
    out["bytes"] = float(sum(p.stat().st_size for p in paths))
    return out


def probe_compute(run_dir: Path, iteration: int, cfg, repeats: int) -> dict[str, float]:
    """Reward scoring and advantage math proper, in-process (no Ray, no store)."""
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    from trajflow.stages.advantage import advantage_table
    from trajflow.stages.reward import score_rows
    from trajflow.batch import join_stages
    from trajflow.store import RunStore

    st = RunStore(run_dir.parent, run_dir.name)
    rollout = pq.read_table(st.stage_path(iteration, "rollout"))
    reward = pq.read_table(st.stage_path(iteration, "reward"))
    cols = [rollout.column(c).to_pylist() for c in ("data_source", "response_text", "ground_truth", "extra_info")]
    reward_cfg = OmegaConf.to_container(cfg.reward, resolve=True)
    if not reward_cfg.get("default_scorer"):
        from trajflow.prompts import load_spec

        reward_cfg["default_scorer"] = load_spec(cfg.data.dataset).get("scorer")
    joined = join_stages([rollout, reward])
    alg = OmegaConf.to_container(cfg.algorithm, resolve=True)
    return {
        "reward scoring proper (score_rows, in-process)": timeit(lambda: score_rows(*cols, reward_cfg), repeats),
        "advantage math proper (advantage_table, in-process)": timeit(lambda: advantage_table(joined, alg), repeats),
    }


def probe_mlflow(root: Path, cfg, metrics: dict, sample_table: dict, gate_json: Path | None, repeats: int) -> dict[str, float]:
    """One iteration's MLflow traffic on a scratch run in the same SQLite store."""
    from omegaconf import OmegaConf

    from trajflow.config import load_config
    from trajflow.tracking import Tracker

    probe_cfg = load_config(base=OmegaConf.create(OmegaConf.to_yaml(cfg)), overrides=["trainer.project_name=overhead-probe"])
    tr = Tracker(probe_cfg, "overhead-probe")
    step = [100]

    def nxt() -> int:
        step[0] += 1
        return step[0]

    gate_metrics = {k: v for k, v in metrics.items() if k.startswith("gate/")} or {"gate/x": 1.0}
    out = {
        f"MLflow log_metrics, iteration dict ({len(metrics)} metrics)": timeit(lambda: tr.log_metrics(metrics, nxt()), repeats),
        f"MLflow log_metrics, gate dict ({len(gate_metrics)} metrics)": timeit(lambda: tr.log_metrics(gate_metrics, nxt()), repeats),
        "MLflow log_table (samples)": timeit(lambda: tr.log_table(sample_table, f"samples/probe_{nxt()}.json"), repeats),
    }
    if gate_json is not None and cfg.gates.enabled:
        out["MLflow log_artifact (gate.json)"] = timeit(lambda: tr.log_artifact(gate_json, f"gates/probe_{nxt()}"), repeats)
    tr.finish("FINISHED")
    return out


def probe_prefect(repeats: int) -> float:
    """Seconds per no-op Prefect task call inside a flow (the flow's task options)."""
    from prefect import flow, task

    from trajflow.flows.tasks import TASK_OPTS

    @task(name="noop", **TASK_OPTS)
    def noop(run_id: str, iteration: int) -> dict:
        return {"run_id": run_id, "iteration": iteration}

    @flow(name="overhead-probe", validate_parameters=False)
    def probe(n: int) -> list[float]:
        noop("warm", 0)
        ts = []
        for i in range(n):
            t = time.perf_counter()
            noop("probe", i)
            ts.append(time.perf_counter() - t)
        return ts

    return statistics.median(probe(max(5, repeats * 3)))


def probe_ray(run_dir: Path, iteration: int, repeats: int) -> dict[str, float]:
    """No-op Ray calls carrying the flow's payloads (Ray must be up)."""
    import numpy as np
    import pyarrow.parquet as pq
    import ray

    from trajflow.batch import join_stages
    from trajflow.store import RunStore

    st = RunStore(run_dir.parent, run_dir.name)
    joined = join_stages([pq.read_table(st.stage_path(iteration, s)) for s in ("rollout", "reward", "advantage")])
    update_batch = {c: joined.column(c).to_pylist() for c in ("prompt_ids", "response_ids", "rollout_logprobs", "advantages")}
    gen_result = {"response_ids": joined.column("response_ids").to_pylist(),
                  "response_text": joined.column("response_text").to_pylist(),
                  "finish_reason": joined.column("finish_reason").to_pylist(),
                  "rollout_logprobs": [np.asarray(x, np.float32) for x in joined.column("rollout_logprobs").to_pylist()]}

    @ray.remote(num_cpus=0)
    class Echo:
        def take(self, batch: dict) -> dict:
            return {"n": len(batch)}

        def give(self, payload: dict) -> dict:
            return payload

    echo = Echo.remote()
    ray.get(echo.take.remote({}))
    cols = [joined.column(c).to_pylist() for c in ("data_source", "response_text", "ground_truth", "extra_info")]

    def task_per_call():
        def noop_task(*args):
            return len(args)

        ray.get(ray.remote(num_cpus=0)(noop_task).remote(*cols))

    out = {
        "Ray actor call, update batch in (update_actor)": timeit(lambda: ray.get(echo.take.remote(update_batch)), repeats),
        "Ray actor call, generation result out (generate_sequences)": timeit(lambda: ray.get(echo.give.remote(gen_result)), repeats),
        "Ray actor call, small (tokenize_prompts, info)": timeit(lambda: ray.get(echo.take.remote({"x": 1})), repeats),
        "Ray task defined per call, reward-sized args (score_rows)": timeit(task_per_call, repeats),
    }
    ray.kill(echo)
    return out


# --------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations after one warm-up (default 3)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats of each probe")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 timed iteration, 16 new tokens, 3 repeats")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (removed at exit otherwise)")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = ap.parse_args()
    extra = list(args.overrides)
    if args.quick:
        args.iterations, args.repeats = 1, 3
        extra = ["rollout.max_new_tokens=16", *extra]
    import pyarrow.parquet as pq
    import ray

    from trajflow.infra.allocator import worker_env_vars
    from trajflow.infra.ray_cluster import local_system_config, loopback_node
    from trajflow.config import load_config

    default_cfg = load_config(None, [])
    root = scratch_dir("bench-overhead-", args.keep)
    overrides = [f"trainer.total_iterations={1 + args.iterations}", "trainer.test_freq=0", "trainer.save_freq=0",
                 "trainer.progress=false", *extra]
    print(f"default recipe with {overrides} in {root}", flush=True)
    cfg = load_config(None, overrides)
    # Start Ray as trajflow.infra.ray_cluster.start_ray would, so it stays up for the Ray probes after the run.
    for attempt in range(3):  # Ray gives its raylet a fixed 30 s to register: a loaded machine can miss it
        try:
            env_vars = worker_env_vars(cfg.resources.allocator)
            with loopback_node():
                ray.init(num_cpus=cfg.resources.num_cpus or os.cpu_count(), include_dashboard=False,
                         _system_config=local_system_config(cfg),
                         logging_level=logging.WARNING, log_to_driver=True,
                         **({"runtime_env": {"env_vars": env_vars}} if env_vars else {}))
            break
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
            print(f"ray.init timed out ({e}); retrying", flush=True)
            ray.shutdown()
    with RssSampler() as mem:
        run = run_trajflow(overrides, root)
    m = run.metrics
    n_it = 1 + args.iterations
    warm = range(1, n_it)

    def col(name: str) -> list[float]:
        return [m.get(name, [0.0] * n_it)[i] for i in warm]

    cycle = [run.cycle_s[i] for i in warm]
    step = col("timing_s/step")
    model = [sum(x) for x in zip(*(col(k) for k in MODEL_COMPUTE))]
    outside = [c - mc for c, mc in zip(cycle, model)]
    share = median([o / c for o, c in zip(outside, cycle)])

    header("per warm iteration (seconds)")
    names = ["cycle", "timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor",
             "timing_s/reward", "timing_s/gate", "timing_s/adv", "model", "outside"]
    print("iter " + " ".join(f"{n.split('/')[-1]:>13s}" for n in names))
    for j, i in enumerate(warm):
        vals = [cycle[j], step[j]] + [m.get(n, [float('nan')] * n_it)[i] for n in names[2:8]] + [model[j], outside[j]]
        print(f"{i + 1:4d} " + " ".join(f"{v:13.3f}" for v in vals))
    it_med = median(cycle)

    header("probes: re-doing each piece on the run's own data")
    last = n_it
    run_dir = Path(run.summary["run_dir"])
    scratch = Path(tempfile.mkdtemp(prefix="bench-overhead-probe-", dir=root))
    per_call: dict[str, tuple[float, int]] = {}  # name -> (seconds per call, calls per iteration)
    for k, v in probe_compute(run_dir, last, cfg, args.repeats).items():
        per_call[k] = (v, 1)
    per_call["GX gate (timing_s/gate from the run: reads, validation, gate.json)"] = (median(col("timing_s/gate")), 1)
    store = probe_store(run_dir, last, scratch, args.repeats)
    size = store.pop("bytes")
    for k, v in store.items():
        per_call[k] = (v, 1)
    rollout_t = pq.read_table(run_dir / "iterations" / f"{last:06d}" / "rollout.parquet")
    k_samples = int(cfg.trainer.log_samples)
    samples = {"sample_id": rollout_t.column("sample_id").to_pylist()[:k_samples],
               "response_text": rollout_t.column("response_text").to_pylist()[:k_samples],
               "ground_truth": rollout_t.column("ground_truth").to_pylist()[:k_samples],
               "score": [0.0] * min(k_samples, rollout_t.num_rows)}
    iter_metrics = {k: v[last - 1] for k, v in m.items() if v[last - 1] == v[last - 1]}
    gate_json = run_dir / "iterations" / f"{last:06d}" / "gate.json"
    for k, v in probe_mlflow(root, cfg, iter_metrics, samples, gate_json if gate_json.exists() else None, args.repeats).items():
        per_call[k] = (v, 1 if "samples" not in k or k_samples else 0)
    per_call["Prefect no-op task round trip"] = (probe_prefect(args.repeats), 5)
    ray_calls = {"update batch in": 1, "generation result out": 1, "small": 2, "defined per call": 1}
    for k, v in probe_ray(run_dir, last, args.repeats).items():
        per_call[k] = (v, next(c for key, c in ray_calls.items() if key in k))
    ray.shutdown()

    print(f"{'piece':86s} {'s/call':>9s} {'calls':>5s} {'s/iter':>8s} {'% iter':>7s}")
    accounted = 0.0
    for k, (v, calls) in per_call.items():
        tot = v * calls
        if not k.startswith("  "):
            accounted += tot
        print(f"{k:86s} {v:9.4f} {calls:5d} {tot:8.3f} {tot / it_med:7.2%}")
    print(f"(stage files written per iteration: {size / 1024:.0f} KiB)")
    out_med = median(outside)
    print(f"{'sum of measured pieces':86s} {'':9s} {'':5s} {accounted:8.3f} {accounted / it_med:7.2%}")
    print(f"{'unattributed (outside model compute - measured pieces)':86s} {'':9s} {'':5s} {out_med - accounted:8.3f} "
          f"{(out_med - accounted) / it_med:7.2%}")
    save = max(run.save_s.values()) if run.save_s else float("nan")
    sf = int(default_cfg.trainer.save_freq) or int(default_cfg.trainer.total_iterations)
    print(f"checkpoint save (not in the iteration above): {save:.2f} s once, {save / sf:.2f} s/iter amortised over the "
          f"default save_freq={sf} ({save / sf / it_med:.1%} of an iteration)")

    header(f"summary (median over {args.iterations} warm iteration(s))")
    print(f"iteration {it_med:.2f} s (timing_s/step {median(step):.2f} s); model compute {median(model):.2f} s; "
          f"outside model compute {out_med:.2f} s = {share:.1%} (of timing_s/step: "
          f"{median([(s - mc) / s for s, mc in zip(step, model)]):.1%})")
    mem.report()
    heavy = [m for m in ("torch", "transformers", "great_expectations", "mlflow", "lancedb") if m in sys.modules]
    print(f"driver's heavy imports after the run: {', '.join(heavy) or 'none'}")
    print(f"wall {run.wall_s:.0f} s including start-up; run dir {run_dir}"
          f"{'' if args.keep else ' (removed at exit; --keep keeps it)'}")

    header("targets")
    verdict("time outside model compute / iteration (default recipe)", share, TARGET_SHARE, higher_is_better=False, fmt="{:.1%}")
    verdict("peak RSS, all processes, GiB (default recipe)", mem.peak_rss / GIB, TARGET_RSS_GIB, higher_is_better=False, fmt="{:.2f}")


if __name__ == "__main__":
    main()
