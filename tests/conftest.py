"""Test-wide settings: the ``slow`` marker and which tests carry it.

    python -m pytest -q                  # everything (the README's and CI's command)
    python -m pytest -q -m "not slow"    # the inner loop: under 4 minutes on two cores

Shared helpers live in plain support modules beside the tests (``search_helpers``,
``spec_helpers``, ``runtime_helpers``, ``runtime_plans``); no test module imports another.

The slow tests are named here, not in their modules, so the tier is one list to read and to
re-measure (``python -m pytest -q --durations=0 -p no:cacheprovider``). A key is a module
(``test_x.py``), a test function (``test_x.py::test_f``, all its parameters) or one
parametrized case (``test_x.py::test_f[id]``). The comment after each is what it took, in
seconds, on the two-core development machine while it was loaded by other work.
"""

from __future__ import annotations

import pytest

SLOW: dict[str, str] = {
    # -- multi-process runtime tests (gloo on CPU ranks): whole modules
    "test_runtime_parallel.py": "",
    "test_runtime_memory.py": "",
    "test_runtime_schedules.py": "",
    "test_runtime_boundary.py": "",
    "test_runtime_context.py": "",
    "test_runtime_shares.py": "",
    "test_runtime_launch.py": "",
    "test_moe_runtime.py": "",
    "test_context_plan.py": "",
    # -- end to end through the command line, a few hundred random requests
    "test_plan_property.py": "",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes long on two cores; deselect with -m 'not slow' "
                                       "(the list is SLOW in tests/conftest.py)")


def _keys(item: pytest.Item) -> tuple[str, ...]:
    module = item.path.name
    function = getattr(item, "originalname", item.name)
    return module, f"{module}::{function}", f"{module}::{item.name}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = pytest.mark.slow
    for item in items:
        if any(key in SLOW for key in _keys(item)):
            item.add_marker(slow)
