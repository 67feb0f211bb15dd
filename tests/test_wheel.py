"""The wheel works outside a checkout: built from the sources, installed in a fresh virtual environment,
run from another folder. It installs nothing at the top level but ``trajflow`` (the repository's
``flows/``, ``stages/`` and ``dashboards/`` become ``trajflow.flows`` and so on), and it carries the data
a run reads (recipes, prompt-dataset specs, expectation suites, deployment definitions).

The fresh environment gets trajflow's dependencies by a ``.pth`` line naming this environment's
``site-packages`` (added after the install, so pip never sees them): no download, and no CUDA torch.
~1 minute: the build ~10 s, ``config --check`` ~10 s, a one-iteration run of the tiny model ~40 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

#: What the wheel is built from (the rest of the checkout is tests, benchmarks and docs).
SOURCES = ("trajflow", "flows", "stages", "dashboards", "datasets", "infra", "pyproject.toml", "setup.py",
           "README.md")


def _clean_env() -> dict[str, str]:
    """This environment without ``PYTHONPATH`` (which points at the checkout when tests run from one)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built without build isolation (setuptools of this environment) from a copy of the
    sources, so that no build/ folder is left in (or reused from) the checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300,
                         env=_clean_env(), cwd=tmp)
    assert out.returncode == 0, out.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("trajflow-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed, then this environment's packages visible."""
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    # --ignore-installed: whatever trajflow the environment can see is never looked at, let alone removed.
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                          "--no-index", "--ignore-installed", str(wheel)], capture_output=True, text=True,
                         timeout=300, env=_clean_env(), cwd=env_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    # A .pth line adds a folder to sys.path without running that folder's own .pth files, so this
    # environment's editable install of the checkout stays out of the fresh one.
    Path(site, "trajflow_test_dependencies.pth").write_text("\n".join(paths) + "\n")
    return env_dir


def _run(venv: Path, cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], cwd=cwd, env=_clean_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_wheel_installs_only_the_trajflow_package_with_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"trajflow", f"{wheel.name.split('-py3')[0]}.dist-info"}
    for data in ("trajflow/flows/configs/grpo_default.yaml", "trajflow/flows/configs/smoke.yaml",
                 "trajflow/datasets/basic_arithmetic.yaml", "trajflow/datasets/expectations/reward_default.json",
                 "trajflow/datasets/prompts/gsm8k_sample.jsonl", "trajflow/infra/prefect/prefect.yaml",
                 "trajflow/infra/prefect/work-pools.yaml", "trajflow/stages/advantage/__init__.py",
                 "trajflow/dashboards/app.py", "trajflow/flows/train.py"):
        assert data in names, data
    shipped = {p.relative_to(REPO).as_posix() for folder in ("flows", "stages", "dashboards")
               for p in (REPO / folder).rglob("*.py")}
    assert {f"trajflow/{p}" for p in shipped} <= set(names)


def test_installed_wheel_imports_each_module_once_under_trajflow(venv, tmp_path):
    code = ("import importlib.util, sys\n"
            "import trajflow.flows.train, trajflow.stages.advantage, trajflow.dashboards.data, trajflow.cli\n"
            "import trajflow\n"
            "print(trajflow.__file__)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in "
            "('flows', 'stages', 'dashboards', 'datasets', 'infra')}))\n"
            "print([n for n in ('flows', 'stages', 'dashboards') if importlib.util.find_spec(n)])\n")
    out = _run(venv, tmp_path, "python", "-c", code)
    assert out.returncode == 0, out.stderr[-3000:]
    where, top_level, findable = out.stdout.strip().splitlines()
    assert Path(where).is_relative_to(venv), where
    assert top_level == "[]" and findable == "[]"


def test_installed_wheel_checks_a_config_and_trains_from_another_folder(venv, tmp_path, tiny_model_dir):
    out = _run(venv, tmp_path, "trajflow", "config", "--check", "-c", "smoke", f"model.path={tiny_model_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "recipe: smoke" in out.stdout
    assert out.stdout.rstrip().splitlines()[-1].startswith("ok: ")  # the answer comes last
    out = _run(venv, tmp_path, "trajflow", "train", "-c", "smoke", f"model.path={tiny_model_dir}",
               "trainer.total_iterations=1", "trainer.test_freq=0", "rollout.max_new_tokens=4",
               "trainer.progress=false", "--run-id", "wheel-smoke", timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "run wheel-smoke done" in out.stdout
    manifest = json.loads((tmp_path / "runs" / "wheel-smoke" / "iterations" / "000001" / "manifest.json").read_text())
    assert manifest["status"] == "complete"
