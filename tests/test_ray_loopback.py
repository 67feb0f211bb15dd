"""The local Ray that trajflow starts listens on loopback only, and still runs actors, placement
groups and the object store."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys

from tests.conftest import REPO

# Runs in a fresh interpreter: the Ray the other tests share (tests/conftest.py) must not be the one
# looked at, and every process this driver starts is one of its descendants.
PROBE = """
import json, time
import numpy as np
import psutil
import ray
from ray._private import ray_constants
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from trajflow.config import load_config
from trajflow.infra.ray_cluster import start_ray, stop_ray


def listening():
    rows = []
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            name = p.name()
            rows += [{"pid": p.pid, "name": name, "ip": c.laddr.ip, "port": c.laddr.port}
                     for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:  # a worker that exited meanwhile
            pass
    return rows


assert start_ray(load_config(None, ["resources.num_cpus=2"]))
try:
    pg = placement_group([{"CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=120)

    @ray.remote(num_cpus=1)
    class Echo:
        def total(self, array):
            return float(array.sum())

    actor = Echo.options(scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg)).remote()
    big = ray.put(np.ones(4_000_000, dtype=np.float32))  # 16 MB: through the shared-memory object store
    assert ray.get(actor.total.remote(big), timeout=120) == 4_000_000
    # The raylet starts its agents after ray.init returns; wait for the runtime-env agent's port
    # (the last one to open), then give the rest a moment.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(r["name"] == "ray::RuntimeEnvAgent" for r in listening()):
        time.sleep(0.5)
    time.sleep(3)
    rows = listening()
    # One task on a worker of its own; then the idle workers Ray keeps (trajflow's _system_config:
    # none prestarted, reward.num_workers = 1 kept).
    assert ray.get(ray.remote(num_cpus=0)(lambda: 1).remote(), timeout=120) == 1
    time.sleep(3)
    idle = []
    for p in psutil.Process().children(recursive=True):
        try:
            idle += [p.pid] if p.cmdline()[:1] == ["ray::IDLE"] else []
        except psutil.Error:
            pass
    ray_cluster_switch = ray_constants.ENABLE_RAY_CLUSTER
finally:
    stop_ray()
print(json.dumps({"listening": rows, "enable_ray_cluster_after": ray_cluster_switch, "idle_workers": idle}))
"""


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)  # gRPC's dual-stack sockets report ::ffff:127.0.0.1
    return (mapped or addr).is_loopback


def test_local_ray_listens_on_loopback_only():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    rows = seen["listening"]
    names = {r["name"] for r in rows}
    # Not vacuous: Ray's core servers and the agents were seen listening.
    assert {"gcs_server", "raylet", "ray::RuntimeEnvAgent"} <= names, rows
    exposed = [f"{r['name']} (pid {r['pid']}) {r['ip']}:{r['port']}" for r in rows if not _is_loopback(r["ip"])]
    assert not exposed, "listening beyond loopback: " + ", ".join(exposed)
    # The switch that makes the node IP loopback is restored: a later ray.init(address=...) or a
    # `ray start` is untouched.
    assert seen["enable_ray_cluster_after"] is True
    # No worker idles through the run: none prestarted, and of the workers the task brought up only
    # the one it ran on is kept (Ray's defaults kept one per CPU, ~80 MB each; trajflow.infra.ray_cluster).
    assert len(seen["idle_workers"]) == 1, seen["idle_workers"]


DEEPSPEED_PROBE = PROBE.split("assert start_ray(")[0] + """
import tempfile
from pathlib import Path
from tests.conftest import make_tiny_model
from tests.test_deepspeed_ranks import spawn_ds

model_dir = make_tiny_model(Path(tempfile.mkdtemp()))
assert start_ray(load_config(None, ["resources.num_cpus=2"]))
try:
    before = {(r["pid"], r["port"]) for r in listening()}
    group = spawn_ds(model_dir, 1)
    pids = [int(p) for p in ray.get([h.__ray_call__.remote(lambda self: __import__("os").getpid())
                                     for h in group.handles])]
    rows = [r for r in listening() if (r["pid"], r["port"]) not in before]
finally:
    stop_ray()
print(json.dumps({"listening": rows, "ranks": pids}))
"""


def test_deepspeed_rendezvous_listens_on_loopback_only():
    """torch's env:// rendezvous serves its TCPStore on every interface; the ranks of a local run
    must meet on the address Ray gave them (loopback), like everything else the run opens."""
    out = subprocess.run([sys.executable, "-c", DEEPSPEED_PROBE], cwd=REPO, capture_output=True, text=True,
                         timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    rows = seen["listening"]
    # Not vacuous: both ranks opened sockets for the process group (the store and gloo's pairs).
    assert {r["pid"] for r in rows} == set(seen["ranks"]), rows
    exposed = [f"{r['name']} (pid {r['pid']}) {r['ip']}:{r['port']}" for r in rows if not _is_loopback(r["ip"])]
    assert not exposed, "listening beyond loopback: " + ", ".join(exposed)
