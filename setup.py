"""Which files the wheel holds (everything else about the project is in pyproject.toml).

The repository keeps ``flows/``, ``stages/`` and ``dashboards/`` at its top level (see
docs/architecture.md); the wheel installs them inside the trajflow package, as ``trajflow.flows``,
``trajflow.stages`` and ``trajflow.dashboards``, so that installing trajflow never adds generic
top-level packages that would shadow a user's own modules. The data read at run time goes with them:
the recipes (``flows/configs/``), the prompt-dataset specs and expectation suites (``datasets/`` ->
``trajflow/datasets/``) and the Prefect deployment definitions (``infra/prefect/`` ->
``trajflow/infra/prefect/``). ``trajflow.LAYOUT_ROOT`` finds them in either place.
"""

from setuptools import find_namespace_packages, find_packages, setup

#: Top-level folders of the repository that are subpackages of trajflow.
SUBPACKAGES = ("flows", "stages", "dashboards")

packages = find_packages(include=["trajflow", "trajflow.*"])
package_dir = {}
for name in SUBPACKAGES:
    package_dir[f"trajflow.{name}"] = name
    packages += [f"trajflow.{name}"] + [f"trajflow.{name}.{sub}" for sub in find_packages(name)]
# Data folders (no __init__.py): every file under them is package data.
DATA = {"trajflow.flows.configs": "flows/configs", "trajflow.datasets": "datasets",
        "trajflow.infra.prefect": "infra/prefect"}
package_data = {}
for package, folder in DATA.items():
    package_dir[package] = folder
    subs = find_namespace_packages(folder)
    packages += [package] + [f"{package}.{sub}" for sub in subs]
    package_data[package] = ["*"]
    package_data.update({f"{package}.{sub}": ["*"] for sub in subs})

setup(packages=packages, package_dir=package_dir, package_data=package_data)
