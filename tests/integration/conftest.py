"""Every test here starts the real server (crane-launch and its processes) or builds the wheel: the
slow tier. `pytest -m "not slow"` leaves them out; a plain run keeps them."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Called with the whole session's items, not only this directory's.
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def native_kernels_built() -> None:
    """The native kernels built (or found in the cache) once, before any server starts: every server
    loads them from the cache instead of the first one compiling them (minutes on a busy machine)."""
    from crane_mp.worker.kernels.cpu_isa import kernel_isa

    kernel_isa()
