"""GPU tier: every test under tests/gpu carries the ``gpu`` marker.

tests/gpu is a package (``gpu``, imported with tests/ on sys.path), so its modules import the
harness relatively: ``from .harness import run_ranks, require_gpus``. Ranks are spawned processes
that inherit the parent's sys.path, so a body defined in a test module is importable there too.
"""

from pathlib import Path

import pytest

_GPU_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # Hooks in a conftest see every collected item, not only this directory's: filter by path.
    for item in items:
        path = Path(str(item.path)).resolve()
        if path == _GPU_DIR or _GPU_DIR in path.parents:
            item.add_marker(pytest.mark.gpu)
