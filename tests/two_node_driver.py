"""Driver run in a subprocess by tests/test_two_node_cluster.py: one `train` flow on an existing
Ray cluster (``resources.ray_address``), then the cluster's nodes, as one JSON line on stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajflow.infra.env import configure_environment  # noqa: E402

configure_environment()


def main() -> None:
    address, model_dir, store_root = sys.argv[1:4]
    overrides = sys.argv[4:]
    import ray

    from trajflow.flows.train import train
    from tests.conftest import tiny_overrides

    summary = train(None, tiny_overrides(Path(model_dir), Path(store_root), **{"resources.ray_address": address})
                    + overrides)
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    nodes = [{"node_id": n["NodeID"], "alive": n["Alive"], "resources": n["Resources"]} for n in ray.nodes()]
    ray.shutdown()
    meta = json.loads((Path(summary["run_dir"]) / "run.json").read_text())
    print("RESULT " + json.dumps({"run_dir": summary["run_dir"], "nodes": nodes, "worker_nodes": meta.get("worker_nodes"),
                                  "policy_version": summary["policy_version"]}))


if __name__ == "__main__":
    main()
