"""A real two-node Ray cluster on loopback: the train flow with split placement puts each role on
the node its pool names.

The head has 2 CPUs; the second node has 1 CPU and a custom ``NPU: 1`` resource (standing in for
an Ascend node: the reference still computes on the CPU, ``trainer.device=cpu``). Pools:
``train`` needs 2 CPUs per slot (only the head has them), ``npu`` needs an ``NPU`` (only the second
node has one). The flow runs in a subprocess (``tests/two_node_driver.py``) so this test never
touches the session's local Ray (``ray_local``).

The cluster runs with ``RAY_AUTH_MODE=disabled``: Ray 2.60 turns token authentication on by
default, and a throwaway loopback cluster has no token to share. It is started with its own
``--temp-dir`` and stopped by terminating exactly the processes whose command line names that
directory (and their children): ``ray stop`` would stop every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_cluster(temp_dir: str) -> None:
    """Terminate the Ray processes of this cluster only (found by their --temp-dir), then their children."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(temp_dir in arg for arg in (p.info["cmdline"] or [])):
                found[p.pid] = p
        except psutil.Error:
            continue
    for p in list(found.values()):
        try:
            for child in p.children(recursive=True):
                found[child.pid] = child
        except psutil.Error:
            pass
    for p in found.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(found.values()), timeout=15)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


@pytest.fixture
def two_node_cluster():
    # Short path: Ray's Unix sockets live under the temp dir and paths are limited to ~107 bytes.
    temp = tempfile.mkdtemp(prefix="tfray-", dir="/tmp")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    port = free_port()
    common = ["--disable-usage-stats", "--node-ip-address", "127.0.0.1"]
    try:
        subprocess.run([RAY, "start", "--head", "--port", str(port), "--num-cpus", "2", "--include-dashboard=false",
                        "--dashboard-port", str(free_port()), "--temp-dir", f"{temp}/head", *common],
                       env=env, check=True, capture_output=True, timeout=300)
        subprocess.run([RAY, "start", "--address", f"127.0.0.1:{port}", "--num-cpus", "1",
                        "--resources", json.dumps({"NPU": 1}), "--temp-dir", f"{temp}/worker", *common],
                       env=env, check=True, capture_output=True, timeout=300)
        yield f"127.0.0.1:{port}", env
    finally:
        stop_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)


def test_split_placement_puts_each_role_on_its_pools_node(two_node_cluster, tiny_model_dir, tmp_path):
    address, env = two_node_cluster
    overrides = ["trainer.total_iterations=1", "trainer.test_freq=0", "actor.kl_loss_coef=0.1",
                 "resources.placement=split",
                 "resources.pools={train: {num_cpus_per_worker: 2}, npu: {device: NPU, num_cpus_per_worker: 1}}",
                 "actor.pool=train", "reference.pool=npu"]
    p = subprocess.run([sys.executable, str(REPO / "tests" / "two_node_driver.py"), address, str(tiny_model_dir),
                        str(tmp_path / "store"), *overrides], env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])
    nodes = {n["node_id"]: n["resources"] for n in result["nodes"] if n["alive"]}
    assert len(nodes) == 2
    head = next(i for i, r in nodes.items() if "node:__internal_head__" in r)
    npu_node = next(i for i, r in nodes.items() if r.get("NPU") == 1.0)
    assert head != npu_node
    assert result["worker_nodes"] == {"actor": [head], "reference": [npu_node]}
    assert result["policy_version"] == 1
    assert (Path(result["run_dir"]) / "final" / "config.json").exists()
