"""The Prefect run graph of a real 2-iteration train run (tiny model, real Ray, Prefect, MLflow on SQLite),
read back from Prefect's API: each stage task run's upstream (its task_inputs, wait_for included) is
exactly what it waits for, rollout -> reward -> gate -> advantage -> update, the next rollout and the
validation after the update: no edge more, none less (flows/graph.py)."""

import pytest

from tests.conftest import tiny_overrides


@pytest.fixture(scope="module")
def graph(tiny_model_dir, ray_local, tmp_path_factory):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    from trajflow.flows.train import train

    root = tmp_path_factory.mktemp("graph-store")
    summary = train(None, tiny_overrides(tiny_model_dir, root, **{"gates.enabled": True, "tracking.log_model": False,
                                                                  "trainer.save_freq": 0}))
    rid = summary["run_id"]
    with get_client(sync_client=True) as client:
        flows = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"train-{rid}"])))
        assert len(flows) == 1
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flows[0].id])))
    names = {t.id: t.name.replace(f"-{rid}-", "-") for t in tasks}
    upstream = {}
    for t in tasks:
        ups = {names.get(i.id, f"outside:{i.id}") for inputs in t.task_inputs.values() for i in inputs
               if getattr(i, "input_type", "") == "task_run"}
        upstream[names[t.id]] = ups
    return upstream


def test_each_stage_waits_for_exactly_what_it_uses(graph):
    expected = {"validate-step0": set()}
    for it in (1, 2):
        before = {f"update-it{it - 1}"} if it > 1 else set()
        r, w, g, a, u = (f"{s}-it{it}" for s in ("rollout", "reward", "gate", "advantage", "update"))
        expected |= {r: before, w: {r}, g: {r, w}, a: {r, w, g}, u: {r, w, g, a}, f"validate-step{it}": {u}}
    assert graph == expected
