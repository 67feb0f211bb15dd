"""trajflow: RL post-training for language models as a Prefect + Ray + Arrow batch pipeline.

The repository keeps ``flows/``, ``stages/``, ``dashboards/``, ``datasets/`` and ``infra/`` at its top
level; they are imported and installed under this package (``trajflow.flows``, ``trajflow.stages``,
``trajflow.dashboards``) so that an installed trajflow never shadows a user's own modules of those
names. The wheel places them inside ``trajflow/`` (see setup.py). In a source checkout they stay
where they are, and :class:`_CheckoutFinder` imports ``trajflow.<name>`` from ``<checkout>/<name>/``.

This module imports nothing heavy: a config error must be reported before torch, Ray, Prefect or
Great Expectations load.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

#: The top-level folders of the repository that are packages of trajflow.
SUBPACKAGES = ("flows", "stages", "dashboards")

_PACKAGE_DIR = Path(__file__).resolve().parent

#: The folder holding the repository's layout (``flows/``, ``stages/``, ``dashboards/``, ``datasets/``,
#: ``infra/prefect/``): the checkout's root, or this package's folder in an installed wheel.
LAYOUT_ROOT = _PACKAGE_DIR if (_PACKAGE_DIR / "flows").is_dir() else _PACKAGE_DIR.parent

#: The folder to put on ``PYTHONPATH`` so that a subprocess imports this same trajflow.
IMPORT_ROOT = _PACKAGE_DIR.parent


class _CheckoutFinder:
    """Finds ``trajflow.flows`` / ``.stages`` / ``.dashboards`` in a source checkout's top-level folders.

    Only those three names: their submodules are then found through the package's ``__path__`` as
    usual, each module is loaded once under its ``trajflow.`` name. An editable install's own finder
    maps the same names to the same folders; this one runs first so that a ``PYTHONPATH`` checkout
    never mixes with another installed copy.
    """

    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None):
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in SUBPACKAGES:
            return None
        folder = LAYOUT_ROOT / name
        init = folder / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(folder)])


if LAYOUT_ROOT != _PACKAGE_DIR and not any(f is _CheckoutFinder for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutFinder)
