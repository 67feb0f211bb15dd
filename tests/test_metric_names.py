"""One spelling of a metric name on every surface (trajflow.metric_names): verl's '@' is '_at_' on the
console, in run.json, in Prefect artifacts and in MLflow, and what a user types in either spelling finds it."""

from trajflow.metric_names import GLOB_CHARS, metric_name, metric_names


def test_at_is_written_as_verls_mlflow_adapter_writes_it_and_the_mapping_is_idempotent():
    verl = "val-core/gsm8k+math/acc/mean@4"
    assert metric_name(verl) == "val-core/gsm8k_math/acc/mean_at_4"
    for name in (verl, "timing(s)/gen", "a//b", "val-core/x/acc/pass@2/mean", "x" * 300 + "@"):
        once = metric_name(name)
        assert "@" not in once and metric_name(once) == once
    assert metric_name("critic/score/mean") == "critic/score/mean"
    # a pattern keeps its glob characters, and '@' in it still matches the stored spelling
    assert metric_name("val-core/*@1", keep=GLOB_CHARS) == "val-core/*_at_1"
    assert metric_names({"val-core/a/acc/mean@1": 0.5, "actor/pg_loss": 1.0}) == {
        "val-core/a/acc/mean_at_1": 0.5, "actor/pg_loss": 1.0}


def test_console_step_line_and_validation_metrics_use_the_one_spelling():
    import numpy as np

    from trajflow.metrics import validation_metrics
    from trajflow.run.progress import step_line

    m = validation_metrics(["a+b"], np.array([1.0]), [{"acc": 1.0}], [[1, 2]], n=1)
    assert m == {"val-core/a_b/acc/mean_at_1": 1.0, "val-aux/a_b/reward/mean_at_1": 1.0,
                 "val-aux/response_length/mean": 2.0}
    # a metric that reached the console in verl's spelling (an older stored result) is shown as MLflow has it
    assert step_line(3, {"critic/score/mean": 0.5, "val-core/x/acc/mean@1": 0.25}) == \
        "step:3 - critic/score/mean:0.500 - val-core/x/acc/mean_at_1:0.250"


def test_runs_listing_reads_runs_written_with_verls_spelling():
    from trajflow.runs import _last_validation

    meta = {"validation_000002": {"val-core/x/acc/mean@1": 0.75, "val-aux/y": 1.0}}
    assert _last_validation(meta) == (2, "val-core/x/acc/mean_at_1", 0.75)
