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
