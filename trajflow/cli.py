"""The ``trajflow`` command line (Typer).

Bad input (config, data, model, run id) is reported as one line on stderr with exit code 2 and no
traceback; anything else is a bug or an infrastructure failure and keeps its traceback.

The commands that run flows (``train``, ``resume``, ``replay``) keep library logs off the console
(they go to ``<run_dir>/logs/driver.log``, see :mod:`trajflow.infra.logs`) unless ``-v`` is given.
Every command that reads or writes runs takes the store root as ``--store``.
"""

from __future__ import annotations

from trajflow.infra.env import configure_environment

configure_environment()

import json  # noqa: E402
import sys  # noqa: E402
from enum import Enum  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import List, Optional  # noqa: E402

import typer  # noqa: E402

from trajflow.stages.names import REPLAY_FROM  # noqa: E402

# rich_markup_mode=None: plain help text (Rich markup would eat [brackets] in the help strings, and
# show flags that take no value as "<bool>").
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="RL post-training for language models: rollout -> reward -> advantage -> update, "
                       "as Prefect flows over Ray workers with Arrow trajectories on disk.")

#: ``replay --from-stage`` choices (``trajflow.stages.names.REPLAY_FROM``).
FromStage = Enum("FromStage", {name: name for name in REPLAY_FROM}, type=str)


class AuditFormat(str, Enum):
    """``audit --format`` choices."""

    table = "table"
    json = "json"
    parquet = "parquet"


STORE_HELP = "store root: the folder holding one folder per run and mlflow.db (default: ./runs)"
VERBOSE_HELP = ("show library logs (Prefect, Ray, MLflow, ...) on the console too; they are always in "
                "<run_dir>/logs/driver.log")
_GLOBAL = {"verbose": False}


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"trajflow {version('trajflow')}")
        except PackageNotFoundError:  # a source checkout that was never installed
            typer.echo("trajflow (not installed: no package metadata)")
        raise typer.Exit()


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
          version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print trajflow's version and exit")) -> None:
    """Global options: -v applies to every command that runs a flow."""
    _GLOBAL["verbose"] = verbose


def _store_root(store: Optional[str]) -> str:
    """``--store``, else ``store.root``'s default."""
    if store:
        return store
    from trajflow.config import StoreConfig

    return StoreConfig().root


def _with_store(overrides: Optional[List[str]], store: Optional[str]) -> list[str]:
    """The overrides plus ``store.root=<--store>``, unless they set ``store.root`` themselves."""
    out = list(overrides or [])
    if store and not any(o.startswith("store.root=") for o in out):
        out.append(f"store.root={store}")
    return out


def _console(verbose: bool, prefect: bool = True) -> None:
    """Route library logs to the run's log file (on the console too with ``-v``), before any flow starts;
    ``prefect=False`` for the checks before a flow, which must not import Prefect (call again before it)."""
    from trajflow.infra.logs import configure_driver

    configure_driver(verbose or _GLOBAL["verbose"], prefect=prefect)


def _run(fn, *args, **kwargs):
    """Call ``fn``; turn bad-input errors into one line + exit 2, a failed gate into exit 3."""
    from trajflow.errors import GateFailed, TrajflowError

    try:
        return fn(*args, **kwargs)
    except GateFailed as e:
        typer.echo(f"gate failed: {e}", err=True)
        raise typer.Exit(3) from None
    except TrajflowError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
def train(overrides: Optional[List[str]] = typer.Argument(None, help="config overrides, key=value"),
          config: Optional[str] = typer.Option(None, "--config", "-c", help="recipe name or YAML path"),
          run_id: Optional[str] = typer.Option(None, "--run-id", help="run id (default: generated)"),
          store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP + "; same as store.root=DIR"),
          verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP)) -> None:
    """Train a policy with a recipe (default: grpo_default) and key=value overrides.

    The console shows a live progress line and one 'step:N - key:value ...' line per iteration
    (and per validation); library logs go to <run_dir>/logs/driver.log.
    """

    def go():
        _console(verbose, prefect=False)
        # Config, data, model and run id are checked before the flow's module (Prefect, Ray, torch) is imported.
        from trajflow.run.start import prepare_train

        prepared = prepare_train(config, _with_store(overrides, store), run_id)
        _console(verbose)
        from trajflow.flows.train import run_training

        return run_training(*prepared)

    summary = _run(go)
    if summary.get("nothing_to_do"):
        typer.echo(f"run {summary['run_id']} already finished all its iterations: nothing to do")
        return
    typer.echo(_done_line(summary))


def _done_line(summary: dict) -> str:
    m = summary.get("metrics", {})
    from trajflow.metric_names import metric_names

    shown = {k: round(v, 4) for k, v in metric_names(m).items() if k.startswith(("val-core", "critic/score/mean"))}
    trained = summary.get("trained_iterations")
    span = f" (trained iterations {trained[0]}..{trained[-1]})" if trained else ""
    return f"run {summary['run_id']} done: {summary['run_dir']} {shown}{span}"


@app.command()
def resume(run_id: str = typer.Argument(..., help="the run to continue"),
           overrides: Optional[List[str]] = typer.Argument(None, help="config overrides, key=value (e.g. "
                                                           "trainer.total_iterations=40)"),
           store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP + "; same as store.root=DIR"),
           verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP)) -> None:
    """Continue a run from its newest complete checkpoint (weights, optimizer, RNG, data cursor).

    Stage outputs of the interrupted iteration that verify (sha256) are reused, the rest re-run; the
    policy update always re-runs. A finished run says so and exits 0.
    """

    def go():
        _console(verbose, prefect=False)
        from trajflow.run.start import prepare_resume

        cfg, done = prepare_resume(run_id, _with_store(overrides, store))
        if done is not None:  # nothing to train: neither Prefect nor Ray is imported
            return done
        _console(verbose)
        from trajflow.flows.train import run_training

        return run_training(cfg, run_id, True)

    summary = _run(go)
    if summary.get("nothing_to_do"):
        last = summary.get("last_checkpoint")
        at = f" (last checkpoint {last:06d})" if isinstance(last, int) else ""
        typer.echo(f"run {run_id} already finished all its iterations{at}: nothing to do; raise "
                   f"trainer.total_iterations to train more")
        return
    typer.echo(_done_line(summary))


@app.command()
def replay(run_id: str = typer.Argument(..., help="the run whose stored iterations are replayed (the parent)"),
           overrides: Optional[List[str]] = typer.Argument(None, help="config overrides for the replay, key=value"),
           iteration: Optional[int] = typer.Option(None, "--iteration", "-i", help="replay this iteration"),
           iterations: Optional[str] = typer.Option(None, "--iterations",
                                                    help="A:B, re-train from checkpoint A-1 on the stored rollouts "
                                                         "of A..B (off-policy by design)"),
           from_stage: FromStage = typer.Option(..., "--from-stage", case_sensitive=False,
                                                help="first stage to recompute"),
           new_run_id: Optional[str] = typer.Option(None, "--run-id",
                                                    help="id of the new run (default: generated)"),
           store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP + "; same as store.root=DIR "
                                                                     "(the parent run and the replay)"),
           verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP)) -> None:
    """Recompute the stages from --from-stage of stored iterations with a (changed) config, into a new run."""

    def go():
        _console(verbose)
        from trajflow.flows.replay import replay as replay_entry

        return replay_entry(run_id, from_stage.value, iteration=iteration, iterations=iterations,
                            overrides=_with_store(overrides, store), run_id=new_run_id)

    summary = _run(go)
    note = f" ({summary['note']})" if summary.get("note") else ""
    typer.echo(f"replay {summary['run_id']} of run {run_id} done: {summary['run_dir']}{note}")


@app.command()
def evaluate(run_id: str = typer.Argument(..., help="the run whose checkpoint is validated"),
             overrides: Optional[List[str]] = typer.Argument(None, help="config overrides for the evaluation, e.g. "
                                                             "rollout.val_n=4 rollout.val_temperature=1.0"),
             checkpoint: Optional[int] = typer.Option(None, "--checkpoint", help="checkpoint iteration "
                                                      "(default: the newest; 0 = the initial model)"),
             store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP),
             verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP)) -> None:
    """Validate a run's checkpoint on its held-out prompts (verl's val_only), logged to MLflow as a
    child of the run; with rollout.val_n > 1 also pass@k for every k <= n, best@k and maj@k."""

    def go():
        _console(verbose)
        from trajflow.flows.evaluate import evaluate_flow, prepare_evaluation
        from trajflow.infra.prefect_server import start_temporary_server

        # Bad input (stored code not consented to, a checkpoint that does not verify) before Prefect and Ray.
        found, step, cfg = prepare_evaluation(_store_root(store), run_id, checkpoint, overrides=list(overrides or []),
                                              quiet=True)
        typer.echo(f"evaluating run {found.run_id} checkpoint {step} on its held-out prompts (data.val_max_prompts="
                   f"{cfg.data.val_max_prompts}, rollout.val_n={cfg.rollout.val_n}): starting Prefect, Ray and the "
                   f"policy worker")
        start_temporary_server()
        return evaluate_flow(run_id=run_id, checkpoint=checkpoint, store_root=_store_root(store),
                             overrides=list(overrides or []))

    result = _run(go)
    from trajflow.run.progress import step_line

    typer.echo(step_line(result["checkpoint"], result["metrics"]))  # train's step:N line, verl's names
    from trajflow.metric_names import metric_names

    for k, v in sorted(metric_names(result["metrics"]).items()):
        if k.startswith("val-"):
            typer.echo(f"{k}: {v:.4f}")
    typer.echo(f"evaluation of {result['run_id']} checkpoint {result['checkpoint']}: {result['path']}")


@app.command()
def audit(run_id: str = typer.Argument(..., help="the run"),
          where: Optional[str] = typer.Option(None, "--where",
                                              help="SQL filter, e.g. \"iteration >= 2 AND score > 0\""),
          search: Optional[str] = typer.Option(None, "--search", help="full-text search over prompt and response"),
          limit: int = typer.Option(50, "--limit", "-k", help="at most this many rows"),
          fmt: AuditFormat = typer.Option(AuditFormat.table, "--format", "-f", case_sensitive=False,
                                          help="output format"),
          output: Optional[Path] = typer.Option(None, "--output", "-o", help="write here (needed for parquet)"),
          store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP),
          store_root: Optional[str] = typer.Option(None, "--store-root", hidden=True),  # the old spelling
          rebuild: bool = typer.Option(False, "--rebuild", help="recreate the audit table from the Parquet files "
                                                               "first")) -> None:
    """Print or export a run's stored trajectories: filter, full-text search, trace to policy and checkpoint."""
    root = _store_root(store or store_root)
    fmt = fmt.value
    if fmt == "parquet" and output is None:
        typer.echo("error: --format parquet needs --output PATH", err=True)
        raise typer.Exit(2)

    def go():
        from trajflow.errors import AuditError
        from trajflow.audit import query_audit, rebuild_audit
        from trajflow.store import RunStore

        if rebuild:
            store = RunStore(root, run_id)
            if not store.exists():
                raise AuditError(f"no run {run_id!r} in store root {store.root}")
            rebuild_audit(store)
        return query_audit(root, run_id, where=where, search=search, limit=limit)

    table = _run(go)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, output)
        typer.echo(f"{table.num_rows} rows written to {output}")
    elif fmt == "json":
        text = json.dumps(table.to_pylist(), indent=1, default=str)
        if output is not None:
            Path(output).write_text(text + "\n")
            typer.echo(f"{table.num_rows} rows written to {output}")
        else:
            typer.echo(text)
    else:
        _print_audit_table(table, output)


class RunsFormat(str, Enum):
    """``runs --format`` choices."""

    table = "table"
    json = "json"


@app.command()
def runs(store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP),
         fmt: RunsFormat = typer.Option(RunsFormat.table, "--format", "-f", case_sensitive=False,
                                        help="output format")) -> None:
    """List the runs of a store: kind, recipe, status, iterations, checkpoints, newest validation, size."""
    from trajflow.runs import format_runs, list_runs

    rows = _run(list_runs, _store_root(store))
    if fmt.value == "json":
        typer.echo(json.dumps(rows, indent=1))
        return
    if not rows:
        typer.echo(f"no runs in {_store_root(store)}")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for name in ("run", "kind", "recipe", "status", "iterations", "checkpoints", "validation", "size", "created"):
        table.add_column(name, no_wrap=name == "run")
    for cells in format_runs(rows):
        table.add_row(*cells)
    Console(width=200).print(table)
    from trajflow.runs import format_bytes

    typer.echo(f"{len(rows)} runs, {format_bytes(sum(int(r['bytes']) for r in rows))} (trajflow gc frees what no "
               f"resume or replay needs)")


@app.command()
def gc(run_ids: Optional[List[str]] = typer.Argument(None, help="only these runs (default: all)"),
       store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP),
       older_checkpoints: bool = typer.Option(False, "--older-checkpoints",
                                              help="also delete checkpoints no resume needs (all but the newest, "
                                                   "the best and replays' starting points); a replay of "
                                                   "iteration N needs checkpoint N-1"),
       yes: bool = typer.Option(False, "--yes", "-y", help="delete; without it, only list what would go")) -> None:
    """Free disk space: leftovers of killed writers, gate data docs of passed gates, with
    --older-checkpoints checkpoints no resume needs. Lists only, unless --yes."""
    from trajflow.prune import apply, plan
    from trajflow.runs import format_bytes

    root = _store_root(store)
    plans = _run(plan, root, list(run_ids or []), older_checkpoints)
    total = 0
    for p in plans:
        if p.skipped:
            typer.echo(f"{p.run_id}: skipped, {p.skipped}")
            continue
        for c in p.candidates:
            typer.echo(f"{p.run_id}: {format_bytes(c.bytes):>9}  {c.what}  ({c.path})")
            total += c.bytes
        for k in p.kept:
            typer.echo(f"{p.run_id}: kept {k}")
    if not yes:
        typer.echo(f"would free {format_bytes(total)} in {root}; nothing deleted (pass --yes to delete)")
        return
    freed = _run(apply, root, plans)
    typer.echo(f"freed {format_bytes(freed)} in {root}")


@app.command()
def export(run_id: str = typer.Argument(..., help="the run"),
           out: Path = typer.Argument(..., help="the folder to write (new or empty)"),
           checkpoint: Optional[int] = typer.Option(None, "--checkpoint", help="checkpoint iteration (default: newest)"),
           lora: str = typer.Option("both", "--lora", help="LoRA runs: both (merged weights, adapter in OUT/adapter), "
                                    "merged, or adapter (OUT is peft's adapter folder)"),
           base: Optional[str] = typer.Option(None, "--base", help="base model, if the run's model.path moved"),
           store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP)) -> None:
    """Write a checkpoint as a Hugging Face model folder (safetensors, config, generation config,
    tokenizer) that AutoModelForCausalLM.from_pretrained loads; any strategy (one process, LoRA,
    FSDP2, DeepSpeed), on the CPU."""
    from trajflow.export import export_run

    r = _run(export_run, _store_root(store), run_id, checkpoint, out, lora=lora, base=base)
    what = {None: "weights", "both": "merged weights + LoRA adapter (adapter/)", "merged": "merged LoRA weights",
            "adapter": "LoRA adapter (peft format)"}[r["lora"]]
    typer.echo(f"exported checkpoint {r['iteration']} of run {run_id} ({r['format']} checkpoint, {what}) to {r['path']}")


def _print_audit_table(table, output: Optional[Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(show_lines=False)
    cols = ("iteration", "sample_id", "score", "advantage_mean", "policy_version", "checkpoint_id", "finish_reason",
            "response_text")
    for c in cols:
        t.add_column(c, no_wrap=c != "response_text", overflow="fold" if c == "response_text" else "ellipsis")
    for row in table.to_pylist():
        cells = []
        for c in cols:
            v = row[c]
            if isinstance(v, float):
                v = f"{v:.4g}"
            elif c == "response_text" and v is not None:
                v = v.replace("\n", "\\n")
                v = v if len(v) <= 80 else v[:77] + "..."
            cells.append("" if v is None else str(v))
        t.add_row(*cells)
    out = open(output, "w") if output is not None else None
    try:
        console = Console(file=out, width=None if out is None and sys.stdout.isatty() else 200)
        console.print(t)
        console.print(f"{table.num_rows} rows")
    finally:
        if out is not None:
            out.close()


@app.command()
def gate(run_id: str = typer.Argument(..., help="run id under the store root"),
         iteration: Optional[int] = typer.Option(None, "--iteration", "-i", help="one iteration (default: all)"),
         suite: Optional[str] = typer.Option(None, "--suite", help="expectation suite file (default: the run's)"),
         store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP)) -> None:
    """Re-validate a run's stored reward outputs (with a stricter suite, say). Exit 3 if a gate fails,
    2 if an iteration's stored outputs cannot be read back (each one is named)."""
    from trajflow.gates import recheck_run

    reports, skipped = _run(recheck_run, _store_root(store), run_id, iteration, suite)
    failed = False
    for it, report in reports:
        status = "ok" if report.success else "FAILED"
        typer.echo(f"iteration {it:6d}: {status} ({report.rows} rows, {len(report.quarantined_sample_ids)} quarantined)")
        for o in report.results:
            typer.echo(f"  {o.line()}")
            if o.status not in ("pass", "skipped") and o.details.get("sample_ids"):
                typer.echo(f"    e.g. sample_ids {', '.join(o.details['sample_ids'][:5])}")
        failed |= not report.success
    if skipped:
        # An iteration that could not be checked is not a pass: name each one and fail.
        typer.echo(f"error: run {run_id}: {len(skipped)} iteration(s) not checked: "
                   + "; ".join(f"iteration {it}: {why}" for it, why in skipped), err=True)
        raise typer.Exit(2)
    if failed:
        raise typer.Exit(3)


@app.command()
def deploy(server: Optional[str] = typer.Option(None, "--server", help="Prefect server URL, e.g. "
                                                "http://127.0.0.1:4200 (default: PREFECT_API_URL)"),
           source: Optional[str] = typer.Option(None, "--source", help="working directory of the flow runs on the "
                                                "worker machines, where their runs/ store goes (default: the "
                                                "current directory)"),
           pool: Optional[str] = typer.Option(None, "--pool", help="work pool name (default: the one in "
                                              "infra/prefect/work-pools.yaml)")) -> None:
    """Register the Prefect deployments (train, evaluate, replay), their work pool, queues and schedules."""
    from trajflow.errors import DeployError
    from trajflow.infra.deploy import deploy as register_all

    try:
        out = register_all(server, source, pool, echo=typer.echo)
    except DeployError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    first_pool = out["pools"][0] if out["pools"] else "POOL"
    typer.echo(f"registered {len(out['deployments'])} deployment(s) on {out['api_url']}. Next:\n"
               f"  PREFECT_API_URL={out['api_url']} prefect worker start --pool {first_pool} --type process\n"
               f"  PREFECT_API_URL={out['api_url']} prefect deployment run train-recipe/train "
               f"--param recipe=grpo_default")


@app.command("config")
def show_config(overrides: Optional[List[str]] = typer.Argument(None, help="config overrides, key=value"),
                config: Optional[str] = typer.Option(None, "--config", "-c",
                                                     help="recipe name or YAML path (default: grpo_default)"),
                store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP + "; same as store.root=DIR"),
                check: bool = typer.Option(False, "--check", help="also check what train checks before it starts: "
                                           "the dataset, the model, the reward function, the gates and the store"),
                help_keys: bool = typer.Option(False, "--help-keys", help="list every config key with its type, "
                                               "default, range and help, and exit")
                ) -> None:
    """Print the resolved config of a recipe plus overrides (its keys, types and values are validated;
    with --check also its data, model, reward and store, as train checks them; starts nothing)."""
    from trajflow.config import load_config, to_yaml

    if help_keys:
        from trajflow.config.schema import key_help

        typer.echo("\n".join(key_help()))
        return
    cfg = _run(load_config, config, _with_store(overrides, store))
    if check:
        from trajflow.run.preflight import preflight

        _run(preflight, cfg)
    typer.echo(to_yaml(cfg))
    if check:  # last, after the YAML: the answer to --check
        typer.echo("ok: the config, its data, model, reward function, gates and store pass the checks train makes")


@app.command()
def compare(runs: List[str] = typer.Argument(..., help="runs: MLflow run id (or unique prefix), run name or trajflow run id"),
            metric: Optional[List[str]] = typer.Option(
                None, "--metric", "-m", help="metric (verl name or glob such as 'actor/*'; repeatable); default: "
                                             "critic/score/mean, response_length/mean and val-core/*"),
            out: str = typer.Option(".", "--out", "-o", help="folder for compare.png and compare.json"),
            store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP),
            tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri",
                                                       help="MLflow tracking URI (default: sqlite under --store)")) -> None:
    """Compare runs side by side: final/best metrics, iterations, wall time, differing config; PNG of the curves."""
    from trajflow.compare import run_compare

    _run(run_compare, runs, metric or None, out, _store_root(store), tracking_uri)


@app.command()
def dashboard(store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP),
              tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri",
                                                         help="MLflow tracking URI (default: sqlite under --store)"),
              port: int = typer.Option(8501, "--port", help="port to serve on"),
              address: str = typer.Option("127.0.0.1", "--address", help="address to bind (0.0.0.0: all interfaces)")) -> None:
    """Serve the dashboard (Streamlit): runs and their curves, trajectory browser, gate results."""
    from trajflow.dashboards.data import serve

    _run(serve, _store_root(store), tracking_uri, port, address)  # replaces this process with Streamlit


def _click_exceptions():
    """The exception module of the Click that Typer runs on (Typer 0.29 vendors its own copy)."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


def _command_path(args: list[str]) -> str:
    """``trajflow <command>`` for a usage error Click raised before it made the command's context
    (an option missing its value): the first word of ``args`` that is not an option, if a command."""
    word = next((a for a in args if not a.startswith("-")), None)
    return f"trajflow {word}" if word in typer.main.get_command(app).commands else "trajflow"


def main() -> None:
    """Console-script entry point.

    A usage error (unknown option, a value outside an option's choices, a missing argument) is one
    line on stderr and exit code 2, like every other bad input, instead of Click's three-line usage
    block.
    """
    ex = _click_exceptions()
    try:
        code = app(standalone_mode=False)
    except KeyboardInterrupt:
        sys.exit(130)
    except ex.NoArgsIsHelpError as e:  # bare `trajflow` / `trajflow audit`: the help
        e.show()
        sys.exit(2)
    except ex.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else _command_path(sys.argv[1:])
        message = " ".join(e.format_message().replace("Value error, ", "").split())  # Click's choice lists: newlines, tabs
        typer.echo(f"error: {where}: {message} (see {where} --help)", err=True)
        sys.exit(2)
    except typer.Abort:  # Click's own Ctrl-C (in a prompt); Typer 0.29's vendored Click has no exceptions.Abort
        sys.exit(130)
    except ex.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
