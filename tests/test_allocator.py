"""resources.allocator: which library the Ray workers preload, checked in a real local Ray."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trajflow.infra.allocator import find_tcmalloc, loaded_allocator, resolve_allocator, worker_env_vars

REPO = Path(__file__).resolve().parents[1]


def test_resolve_allocator(tmp_path, monkeypatch):
    assert resolve_allocator("system") is None
    assert resolve_allocator("auto") == find_tcmalloc()
    lib = tmp_path / "libfake.so"
    lib.write_bytes(b"\x7fELF\x02\x01\x01")  # what the loader checks first: the ELF magic
    assert resolve_allocator(str(lib)) == str(lib.resolve())
    with pytest.raises(ValueError, match=r"resources.allocator='/no/such/lib.so' is not allowed.*no such file"):
        resolve_allocator("/no/such/lib.so")
    text = tmp_path / "notalib.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"not a shared library \(no ELF header\)"):
        resolve_allocator(str(text))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert worker_env_vars("system") == {}
    assert worker_env_vars(str(lib)) == {"LD_PRELOAD": str(lib.resolve())}
    # A preload the user exported stays, after the allocator (which must come first to serve malloc).
    monkeypatch.setenv("LD_PRELOAD", "/opt/x/libother.so")
    assert worker_env_vars(str(lib)) == {"LD_PRELOAD": f"{lib.resolve()}:/opt/x/libother.so"}
    monkeypatch.setenv("LD_PRELOAD", f"/opt/x/libother.so:{lib.resolve()}")
    assert worker_env_vars(str(lib)) == {"LD_PRELOAD": f"/opt/x/libother.so:{lib.resolve()}"}
    # auto leaves an allocator the user preloads alone (the workers inherit it; two would be loaded).
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    assert worker_env_vars("auto") == {}


def test_bad_allocator_and_token_budget_are_config_errors(tmp_path):
    from trajflow.errors import ConfigError
    from trajflow.config import load_config

    with pytest.raises(ConfigError, match=r"resources.allocator='/no/such/lib.so' is not allowed"):
        load_config(None, ["resources.allocator=/no/such/lib.so"])
    text = tmp_path / "notalib.txt"
    text.write_text("hello")
    with pytest.raises(ConfigError, match=r"not a shared library"):
        load_config(None, [f"resources.allocator={text}"])
    # A token budget below one row (prompt cap + response cap = 512 + 32).
    cap = ["rollout.max_new_tokens=32", "actor.use_dynamic_bsz=true"]
    with pytest.raises(ConfigError, match=r"actor.ppo_max_token_len_per_gpu=100 must be >= "
                                          r"data.max_prompt_length \+ rollout.max_new_tokens = 544"):
        load_config(None, cap + ["actor.ppo_max_token_len_per_gpu=100"])
    assert load_config(None, cap + ["actor.ppo_max_token_len_per_gpu=544"]).actor.use_dynamic_bsz


PROBE = """
import json, sys
import ray
from trajflow.config import load_config
from trajflow.infra.ray_cluster import start_ray, stop_ray
from trajflow.infra.allocator import loaded_allocator

cfg = load_config(None, sys.argv[1:])
start_ray(cfg)
try:
    probe = ray.remote(num_cpus=0)(lambda: loaded_allocator()).remote()
    print(json.dumps({"worker": ray.get(probe, timeout=120), "driver": loaded_allocator()}))
finally:
    stop_ray()
"""


def _probe(*overrides: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, *overrides], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(find_tcmalloc() is None, reason="no tcmalloc on this machine (.ci/run installs it)")
def test_ray_workers_preload_tcmalloc_and_the_driver_does_not():
    seen = _probe()  # resources.allocator=auto
    assert seen["worker"] is not None and Path(seen["worker"]).name.startswith("libtcmalloc")
    if "LD_PRELOAD" not in os.environ:  # the driver holds no model and keeps its allocator
        assert seen["driver"] is None
    assert _probe("resources.allocator=system")["worker"] is None


RELEASE_PROBE = """
import ctypes, json, os
from trajflow.infra.allocator import release_free_memory

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
# 2,000 blocks of 64 KiB (below glibc's mmap threshold, so from the heap), each written, then one
# more from the heap's top that stays in use: freeing the others leaves 125 MiB of free heap below
# it, which free() cannot give back (it only shrinks the heap from the top).
blocks = [libc.malloc(64 * 1024) for _ in range(2000)]
for b in blocks:
    ctypes.memset(b, 1, 64 * 1024)
pin = libc.malloc(64 * 1024)
ctypes.memset(pin, 1, 64 * 1024)
for b in blocks:
    libc.free(b)
before = rss()
which = release_free_memory()
print(json.dumps({"which": which, "freed": before - rss()}))
"""


def test_release_free_memory_returns_freed_heap_pages_to_the_system():
    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LD_PRELOAD": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["which"] == "glibc"
    assert seen["freed"] > 100 * 2**20, seen  # most of the 125 MiB left resident by free()


def test_configure_environment_caps_malloc_arenas(monkeypatch):
    from trajflow.infra.allocator import limit_malloc_arenas
    from trajflow.infra.env import configure_environment

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    configure_environment()
    assert os.environ["MALLOC_ARENA_MAX"] == "2"  # inherited by the processes started from here
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    configure_environment()
    assert os.environ["MALLOC_ARENA_MAX"] == "4"  # a user's choice wins
    assert limit_malloc_arenas(2) is True  # glibc accepts it in a running process


@pytest.mark.parametrize("overrides,want", [
    ([], False),  # GRPO, nothing else resident: the update would only fault its pages in again
    (["algorithm.adv_estimator=gae"], True),  # a critic updates while the actor idles
    (["actor.kl_loss_coef=0.01"], True),  # a reference worker
    (["resources.release_memory=always"], True),
    (["algorithm.adv_estimator=gae", "resources.release_memory=never"], False),
])
def test_release_memory_auto_releases_only_where_other_model_workers_hold_memory(tmp_path, overrides, want):
    from trajflow.config import load_config
    from trajflow.run.context import RunContext
    from trajflow.store import RunStore

    cfg = load_config(None, overrides)
    assert RunContext(cfg=cfg, store=RunStore(tmp_path, "r"), model_path="m").release_memory() is want


def test_release_memory_names_its_choices():
    from trajflow.config import load_config
    from trajflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"resources.release_memory.*auto.*always.*never"):
        load_config(None, ["resources.release_memory=sometimes"])
