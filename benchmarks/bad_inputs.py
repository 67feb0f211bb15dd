"""Bad-input sweep: every kind of bad input a user gives the CLI, and whether each is handled cleanly.

Clean means: exit code 2 (3 for a failed gate), exactly one non-empty line on stderr that starts with
``error:`` (or ``gate failed:``) and names what is wrong, no traceback, and for ``train`` no run
folder left behind (the store root holds what it held before). Prints one row per case and the
count; exits 1 if any case is not clean.

    .venv/bin/python benchmarks/bad_inputs.py            # all cases, 2 at a time
    .venv/bin/python benchmarks/bad_inputs.py -k gate,audit   # the cases naming gate or audit

It trains one tiny run first (a 2-layer model with SmolLM2's tokenizer, ~1 min) for the cases that
need a stored run (resume, replay, audit, gate, compare, evaluate); tampered copies of it (a forged
checkpoint manifest, a garbage ``run.json``, code planted in its ``config.yaml``, ...) live under their
own store roots. A planted reward function writes a marker file if it is ever imported: a case that
lets it run is not clean. Three cases run a real flow to its reward stage (a timeout, a NaN reward,
a scorer that raises under the gate).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = Path(tempfile.gettempdir()) / "trajflow-bad-inputs-MARKER"
TRAJFLOW = str(Path(sys.executable).parent / "trajflow")


@dataclass
class Case:
    name: str
    args: list[str]
    needles: list[str] = field(default_factory=list)  # each must appear in the error line
    rc: int = 2


def _tiny_overrides(model: Path, root: Path) -> list[str]:
    return [f"model.path={model}", f"store.root={root}", "data.train_batch_size=2", "data.val_max_prompts=2",
            "rollout.n=2", "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=2",
            "actor.ppo_micro_batch_size=2", "trainer.total_iterations=2", "trainer.save_freq=1",
            "trainer.test_freq=0", "trainer.progress=false", "tracking.log_model=false",
            "tracking.system_metrics=false", "reward.overlong_buffer.enable=false",
            "actor.mixed_precision.param_dtype=float32", "rollout.dtype=float32"]


#: Environment factories and scorers of a user's own, on PYTHONPATH for the cases (see :func:`main`).
USER_CODE = {
    "user_envs.py": "from trajflow.envs.registry import ToolEnvironment\n\n"
                    "def raises(ctx):\n    raise RuntimeError('no such dataset')\n\n"
                    "def wrong_type(ctx):\n    return {'not': 'an environment'}\n",
    "slow.py": "import time\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
               "    time.sleep(60)\n    return 0.0\n",
    "nan.py": "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n",
    "raises.py": "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    raise KeyError('answer')\n",
    "planted.py": "import pathlib, tempfile\n"
                  "pathlib.Path(tempfile.gettempdir(), 'trajflow-bad-inputs-MARKER').write_text('ran')\n"
                  "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
}

#: The dashboard's data layer as the app calls it: a DashboardError is what the page shows (one line).
DASHBOARD = ("import sys\nfrom trajflow.dashboards.data import find_trajectories, trajectory_facets\n"
             "from trajflow.errors import DashboardError\ntry:\n    find_trajectories(sys.argv[1], sys.argv[2])\n"
             "    trajectory_facets(sys.argv[1], sys.argv[2])\nexcept DashboardError as e:\n"
             "    print(f'error: {e}', file=sys.stderr)\n    sys.exit(2)\n")


def _tampered(store: Path, run: str, tmp: Path, name: str, change) -> Path:
    """A copy of the stored run under its own store root, changed by ``change(run_dir)``."""
    root = tmp / "tampered" / name.replace("/", "-").replace(" ", "-")
    shutil.copytree(store / run, root / run, symlinks=True)
    change(root / run)
    return root


def _forge_manifest(run_dir: Path) -> None:
    """Garbage weights in checkpoint 1, its manifest rewritten to match them."""
    import hashlib

    d = run_dir / "checkpoints" / "000001"
    (d / "actor" / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    files = {str(p.relative_to(d)): {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "bytes": p.stat().st_size}
             for p in sorted(d.rglob("*")) if p.is_file() and p.name not in ("manifest.json", "trainer_state.json")}
    (d / "manifest.json").write_text(json.dumps({"files": files}))


def _lock_folder(run_dir: Path) -> None:
    """The run's lock file replaced by a folder of that name."""
    (run_dir / ".lock").unlink(missing_ok=True)
    (run_dir / ".lock").mkdir()


def _plant(run_dir: Path, key: str, value: str) -> None:
    """Point ``key`` of the stored config at code of someone else's (``a.b.c``)."""
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    *path, last = key.split(".")
    node = cfg
    for k in path:
        node = node[k]
    node[last] = value
    if key.startswith("rollout.multi_turn."):
        cfg["rollout"]["multi_turn"]["enable"] = True
    cfg["reward"]["trust_changed_custom_function"] = True  # a consent flag in the same file grants nothing
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))


def _files(tmp: Path, model: Path) -> dict[str, Path]:
    """The bad files the cases point at."""
    f = {}

    def write(name: str, data: str | bytes) -> Path:
        p = tmp / name
        (p.write_bytes if isinstance(data, bytes) else p.write_text)(data)
        f[name] = p
        return p

    write("syntax.py", "def score(:\n")
    write("ok.py", "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    write("bad.json", "{not json")
    write("list.json", "[1, 2]")
    write("bad.yaml", "a: [1, 2\n")
    write("list.yaml", "- 1\n- 2\n")
    write("latin1.jsonl", '{"prompt": "caf\xe9", "ground_truth": "1"}\n'.encode("latin-1"))
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
             "reward_model": {"ground_truth": "2"}}]
    write("one_row.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    write("no_prompt.jsonl", json.dumps({"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "3"}}) + "\n")
    write("empty_prompt.jsonl", json.dumps({"data_source": "openai/gsm8k", "prompt": "",
                                            "reward_model": {"ground_truth": "3"}}) + "\n")
    write("no_truth.jsonl", json.dumps({"data_source": "openai/gsm8k", "prompt": "2+2?"}) + "\n")
    write("broken.jsonl", '{"prompt": "1+1?", "ground_truth": "2"}\n{"prompt": \n')
    write("empty.jsonl", "")
    write("unmapped.jsonl", json.dumps({"data_source": "acme/unknown", "prompt": "1+1?",
                                        "reward_model": {"ground_truth": "2"}}) + "\n")
    write("long.jsonl", json.dumps({"data_source": "openai/gsm8k", "prompt": "word " * 3000,
                                    "reward_model": {"ground_truth": "2"}}) + "\n")
    write("not_parquet.parquet", b"PAR1garbage")
    broken = tmp / "broken-model"
    shutil.copytree(model, broken)
    next(broken.glob("*.safetensors")).write_bytes(b"\x00garbage" * 8)
    f["broken-model"] = broken
    no_config = tmp / "no-config-model"
    shutil.copytree(model, no_config)
    (no_config / "config.json").unlink()
    f["no-config-model"] = no_config
    f["a_file"] = write("a_file", "not a folder")
    pickled = tmp / "pickle-model"
    pickled.mkdir()
    shutil.copy(model / "config.json", pickled / "config.json")
    import torch

    torch.save({"w": torch.zeros(2)}, pickled / "pytorch_model.bin")
    f["pickle-model"] = pickled
    for name, text in USER_CODE.items():
        write(name, text)
    return f


def cases(tmp: Path, model: Path, store: Path, run: str) -> list[Case]:
    f = _files(tmp, model)
    fresh = tmp / "fresh-store"
    t = _tiny_overrides(model, fresh)

    def train(name: str, *extra: str, needles=(), base=t) -> Case:
        return Case(f"train/{name}", ["train", *base, *extra], list(needles))

    s = f"store.root={store}"
    out = [
        # config keys and values
        train("unknown key", "actor.lrr=1e-5", needles=["actor.lrr", "actor.lr"]),
        train("unknown section", "nosuch.key=1", needles=["nosuch"]),
        train("not key=value", "actor", needles=["key=value"]),
        train("wrong type", "actor.lr=fast", needles=["actor.lr", "fast"]),
        train("bool type", "trainer.progress=maybe", needles=["trainer.progress"]),
        train("list for scalar", "actor.lr=[1,2]", needles=["actor.lr"]),
        train("below range", "rollout.n=0", needles=["rollout.n"]),
        train("above range", "rollout.top_p=1.5", needles=["rollout.top_p"]),
        train("unknown choice", "algorithm.adv_estimator=grpoo", needles=["algorithm.adv_estimator", "grpo"]),
        train("unknown policy loss", "actor.policy_loss=nosuch", needles=["actor.policy_loss"]),
        train("infinite lr", "actor.lr=inf", needles=["actor.lr"]),
        train("nan score_min", "gates.score_min=nan", needles=["gates.score_min"]),
        train("score_min > score_max", "gates.score_min=2", "gates.score_max=1", needles=["gates.score_min"]),
        train("betas out of range", "actor.betas=[2,3]", needles=["actor.betas"]),
        train("betas wrong length", "actor.betas=[0.9]", needles=["actor.betas"]),
        train("n=1 with grpo", "rollout.n=1", needles=["rollout.n"]),
        train("mini batch > batch", "actor.ppo_mini_batch_size=4", needles=["actor.ppo_mini_batch_size"]),
        train("batch not a multiple", "data.train_batch_size=3", needles=["data.train_batch_size"]),
        train("gspo with token-mean", "actor.policy_loss=gspo", "actor.loss_agg_mode=token-mean",
              needles=["actor.policy_loss=gspo"]),
        train("vllm on cpu", "rollout.engine=vllm", needles=["rollout.engine"]),
        train("unknown stage timeout", "trainer.stage_timeouts={nosuch: 5}", needles=["trainer.stage_timeouts"]),
        train("unknown gate policy", "gates.policies={nosuch_gate: fail}", needles=["nosuch_gate"]),
        train("bad gate policy value", "gates.policies={score_range: explode}", needles=["explode"]),
        train("env interpolation", "trainer.run_id=${oc.env:NO_SUCH_TRAJFLOW_VAR}", needles=["oc.env"]),
        train("register without log_model", "tracking.register_model=p", "tracking.log_model=false",
              needles=["tracking.register_model"]),
        train("token budget below a row", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4",
              needles=["actor.ppo_max_token_len_per_gpu"]),
        train("unknown allocator", "resources.allocator=/nope/libx.so", needles=["allocator"]),
        Case("train/missing recipe", ["train", "--config", "no_such_recipe", *t], ["no_such_recipe"]),
        Case("train/recipe yaml error", ["train", "--config", str(f["bad.yaml"]), *t], ["bad.yaml"]),
        Case("train/recipe is a list", ["train", "--config", str(f["list.yaml"]), *t], ["list.yaml"]),
        # run ids and the store
        train("overlong run id", "--run-id", "r" * 300, needles=["run id"]),
        train("run id with a slash", "--run-id", "a/b", needles=["a/b"]),
        train("store root is a file", f"store.root={f['a_file']}/runs", base=[x for x in t if not x.startswith("store.root=")],
              needles=["store.root"]),
        Case("train/run exists", ["train", *_tiny_overrides(model, store), "--run-id", run], [run]),
        # model
        train("missing model", f"model.path={tmp / 'nope'}", needles=["model.path", "nope"]),
        train("corrupt weights", f"model.path={f['broken-model']}", needles=["model.safetensors"]),
        train("model without config", f"model.path={f['no-config-model']}", needles=["config.json"]),
        # data
        train("unknown dataset", "data.dataset=nosuch_dataset", needles=["nosuch_dataset"]),
        train("missing data file", f"data.dataset={tmp / 'nope.jsonl'}", needles=["nope.jsonl"]),
        train("non-UTF-8 data", f"data.dataset={f['latin1.jsonl']}", needles=["latin1.jsonl"]),
        train("malformed JSON line", f"data.dataset={f['broken.jsonl']}", needles=["broken.jsonl", "2"]),
        train("row without prompt", f"data.dataset={f['no_prompt.jsonl']}", needles=["no_prompt.jsonl"]),
        train("empty prompt", f"data.dataset={f['empty_prompt.jsonl']}", needles=["empty_prompt.jsonl"]),
        train("row without ground truth", f"data.dataset={f['no_truth.jsonl']}", needles=["no_truth.jsonl"]),
        train("empty data file", f"data.dataset={f['empty.jsonl']}", needles=["empty.jsonl"]),
        train("not a Parquet file", f"data.dataset={f['not_parquet.parquet']}", needles=["not_parquet.parquet"]),
        train("unmapped data_source", f"data.dataset={f['unmapped.jsonl']}", "data.train_batch_size=1",
              "actor.ppo_mini_batch_size=1", needles=["acme/unknown"]),
        train("batch larger than the data", f"data.dataset={f['one_row.jsonl']}", needles=["data.train_batch_size"]),
        train("prompt longer than the context", f"data.dataset={f['long.jsonl']}", "data.train_batch_size=1",
              "actor.ppo_mini_batch_size=1", needles=["long.jsonl"]),
        # reward function and gates
        train("custom function file missing", f"reward.custom_function={tmp}/nope.py:score", needles=["nope.py"]),
        train("custom function syntax error", f"reward.custom_function={f['syntax.py']}:score",
              needles=["syntax.py"]),
        train("custom function name missing", f"reward.custom_function={f['ok.py']}:nosuch", needles=["nosuch"]),
        train("gate suite missing", "gates.enabled=true", f"gates.suite={tmp}/nosuch.json", needles=["nosuch.json"]),
        train("gate suite malformed", "gates.enabled=true", f"gates.suite={f['bad.json']}", needles=["bad.json"]),
        train("gate suite not an object", "gates.enabled=true", f"gates.suite={f['list.json']}",
              needles=["list.json"]),
        # stored runs
        Case("resume/unknown run", ["resume", "nope", s], ["nope"]),
        Case("resume/store root missing", ["resume", run, f"store.root={tmp / 'no-store'}"], ["no-store"]),
        Case("replay/unknown run", ["replay", "nope", "--iteration", "1", "--from-stage", "reward", s], ["nope"]),
        Case("replay/unknown iteration", ["replay", run, "--iteration", "9", "--from-stage", "reward", s], ["9"]),
        Case("replay/unknown stage", ["replay", run, "--iteration", "1", "--from-stage", "bogus", s], ["bogus"]),
        Case("replay/bad iteration range", ["replay", run, "--iterations", "3:1", "--from-stage", "reward", s],
             ["3:1"]),
        Case("audit/unknown run", ["audit", "nope", "--store", str(store)], ["nope"]),
        Case("audit/bad where", ["audit", run, "--store", str(store), "--where", "score >>> 1"], ["score >>> 1"]),
        Case("audit/unknown format", ["audit", run, "--store", str(store), "--format", "xml"], ["xml"]),
        Case("audit/parquet without output", ["audit", run, "--store", str(store), "--format", "parquet"],
             ["--output"]),
        Case("gate/unknown run", ["gate", "nope", "--store", str(store)], ["nope"]),
        Case("gate/malformed suite", ["gate", run, "--store", str(store), "--suite", str(f["bad.json"])], ["bad.json"]),
        Case("gate/unknown iteration", ["gate", run, "--store", str(store), "--iteration", "9"], ["9"]),
        Case("compare/unknown run", ["compare", "nope", "--store", str(store), "--out", str(tmp / "cmp")], ["nope"]),
        Case("compare/no store", ["compare", "x", "--store", str(tmp / "no-store"), "--out", str(tmp / "cmp")],
             ["no-store"]),
        Case("config/unknown key", ["config", "actor.lrr=1"], ["actor.lrr"]),
        # config values
        train("malformed YAML override value", "resources.pools={a:{b:1}}", needles=["resources.pools", "YAML"]),
        train("seed as a float", "trainer.seed=1e23", needles=["trainer.seed"]),
        train("seed too large", "trainer.seed=100000000000000000000000", needles=["trainer.seed"]),
        train("run id with a newline", "--run-id", "a\nb", needles=["control character"]),
        train("store root under /proc", "store.root=/proc/trajflow-runs",
              base=[x for x in t if not x.startswith("store.root=")], needles=["store.root", "/proc"]),
        train("model holding only a pickle", f"model.path={f['pickle-model']}", needles=["pytorch_model.bin"]),
        # environment factories
        *[train(f"environment {name}", "rollout.multi_turn.enable=true", "model.prompt_format=auto",
                f"rollout.multi_turn.environment={factory}", needles=[factory])
          for name, factory in (("os:system", "os:system"), ("factory raises", "user_envs:raises"),
                                ("factory returns the wrong type", "user_envs:wrong_type"))],
        # the reward stage, in a real run (Ray, Prefect): each ends with one line
        train("reward timeout", f"reward.custom_function={tmp / 'slow.py'}:score", "trainer.stage_timeouts={reward: 3}",
              "trainer.stage_retries=0", base=_tiny_overrides(model, tmp / "flow-store"),
              needles=["trainer.stage_timeouts.reward"]),
        train("NaN reward with the gate off", f"reward.custom_function={tmp / 'nan.py'}:score", "gates.enabled=false",
              base=_tiny_overrides(model, tmp / "flow-store"), needles=["NaN"]),
        Case("train/gate stop names the scorer's exception",
             ["train", *_tiny_overrides(model, tmp / "flow-store"), f"reward.custom_function={tmp / 'raises.py'}:score",
              "gates.enabled=true"], ["KeyError", "answer"], rc=3),
        # tampered run folders
        Case("evaluate/truncated checkpoint weights",
             ["evaluate", run, "--checkpoint", "1", "--store", str(_tampered(store, run, tmp, "trunc", lambda d: (
                 d / "checkpoints/000001/actor/model.safetensors").write_bytes(b"\x00" * 100)))],
             ["model.safetensors", "manifest"]),
        Case("evaluate/missing checkpoint weights",
             ["evaluate", run, "--checkpoint", "1", "--store", str(_tampered(store, run, tmp, "missing", lambda d: (
                 d / "checkpoints/000001/actor/model.safetensors").unlink()))], ["model.safetensors", "missing"]),
        Case("evaluate/forged checkpoint manifest",
             ["evaluate", run, "--checkpoint", "1", "--store", str(_tampered(store, run, tmp, "forged", _forge_manifest))],
             ["model.safetensors"]),
        Case("replay/forged checkpoint manifest",
             ["replay", run, "--iteration", "2", "--from-stage", "update",
              f"store.root={_tampered(store, run, tmp, 'forged-replay', _forge_manifest)}"], ["model.safetensors"]),
        Case("resume/garbage run.json",
             ["resume", run, f"store.root={_tampered(store, run, tmp, 'meta', lambda d: (d / 'run.json').write_text('{x'))}"],
             ["run.json"]),
        Case("resume/lock is a folder",
             ["resume", run, f"store.root={_tampered(store, run, tmp, 'lockdir', _lock_folder)}"],
             [".lock"]),
        Case("audit/run id with a newline", ["audit", "a\nb", "--store", str(store)], ["control character"]),
        *[Case(f"{cmd}/planted {what}", [*args(_tampered(store, run, tmp, f"plant-{cmd}-{what}",
                                                         lambda d, k=key, v=value: _plant(d, k, v)))],
               ["code named by a run folder"])
          for what, key, value in (("reward function", "reward.custom_function", f"{tmp / 'planted.py'}:score"),
                                   ("environment", "rollout.multi_turn.environment", "planted:score"))
          for cmd, args in (("resume", lambda r: ["resume", run, f"store.root={r}"]),
                            ("replay", lambda r: ["replay", run, "-i", "1", "--from-stage", "reward", f"store.root={r}"]),
                            ("evaluate", lambda r: ["evaluate", run, "--checkpoint", "0", "--store", str(r)]))],
        Case("dashboard/corrupt Parquet", [sys.executable, "-c", DASHBOARD, str(_tampered(
            store, run, tmp, "corrupt", lambda d: (d / "iterations/000001/reward.parquet").write_bytes(b"PAR1x"))), run],
             ["reward.parquet"]),
        Case("dashboard/symlinked Parquet", [sys.executable, "-c", DASHBOARD, str(_tampered(
            store, run, tmp, "symlink", lambda d: ((d / "iterations/000001/reward.parquet").unlink(),
                                                   (d / "iterations/000001/reward.parquet").symlink_to("/dev/zero")))),
            run], ["reward.parquet", "symlink"]),
    ]
    return out


@dataclass
class Result:
    case: Case
    rc: int
    stderr: str
    seconds: float
    leftover: list[str]

    @property
    def line(self) -> str:
        lines = [x for x in self.stderr.strip().splitlines() if x.strip()]
        return lines[0] if len(lines) == 1 else ""

    @property
    def problems(self) -> list[str]:
        out = []
        lines = [x for x in self.stderr.strip().splitlines() if x.strip()]
        if self.rc != self.case.rc:
            out.append(f"exit {self.rc}")
        if "Traceback" in self.stderr:
            out.append("traceback")
        if len(lines) != 1:
            out.append(f"{len(lines)} stderr lines")
        elif not lines[0].startswith(("error:", "gate failed:")):
            out.append("not an error line")
        missing = [n for n in self.case.needles if n not in self.line]
        if missing and len(lines) == 1:
            out.append(f"does not name {missing}")
        if self.leftover:
            out.append(f"left {self.leftover}")
        return out


def run_case(case: Case, env: dict, fresh: Path) -> Result:
    before = set(os.listdir(fresh)) if fresh.is_dir() else set()
    t0 = time.perf_counter()
    argv = case.args if case.args[0] == sys.executable else [TRAJFLOW, *case.args]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=str(REPO))
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = -1, f"timed out after 300 s\n{e.stderr or ''}"
    after = set(os.listdir(fresh)) if fresh.is_dir() else set()
    leftover = sorted(x for x in after - before if x not in ("mlflow.db", "mlartifacts"))
    if MARKER.exists():  # code named by a run folder ran
        leftover.append(f"{MARKER} (planted code ran)")
    return Result(case, rc, err, time.perf_counter() - t0, leftover)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only cases whose name contains one of these (comma-separated)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.conftest import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="trajflow-bad-inputs-"))
    env = dict(os.environ, PREFECT_HOME=str(tmp / "prefect"), TRAJFLOW_CACHE=str(tmp / "cache"),
               PYTHONPATH=os.pathsep.join([str(tmp), str(REPO), os.environ.get("PYTHONPATH", "")]))
    MARKER.unlink(missing_ok=True)
    try:
        model = make_tiny_model(tmp / "model")
        store = tmp / "store"
        run = "stored"
        p = subprocess.run([TRAJFLOW, "train", *_tiny_overrides(model, store), "--run-id", run],
                           capture_output=True, text=True, env=env, cwd=str(REPO))
        if p.returncode != 0:
            print(f"the stored run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
            return 1
        wanted = args.k.split(",")
        chosen = [c for c in cases(tmp, model, store, run) if any(w in c.name for w in wanted)]
        with ThreadPoolExecutor(args.workers) as pool:
            results = list(pool.map(lambda c: run_case(c, env, tmp / "fresh-store"), chosen))
        width = max(len(r.case.name) for r in results)
        for r in results:
            verdict = "clean" if not r.problems else "NOT CLEAN: " + ", ".join(r.problems)
            shown = r.line or (r.stderr.strip().splitlines() or [""])[-1]
            print(f"{r.case.name:<{width}}  {r.seconds:5.1f}s  {verdict}\n{'':<{width}}  {shown[:160]}")
        clean = sum(not r.problems for r in results)
        print(f"\n{clean} of {len(results)} bad inputs handled cleanly")
        return 0 if clean == len(results) else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
