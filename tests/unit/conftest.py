"""The in-process frontend over the fake scheduler (frontend_harness.py) as fixtures: a module's tests
ask for `frontend`, and parametrize `server_args` for ServerConfig fields of their own. A module that
defines its own `model_dir` or `frontend` uses those instead."""

from __future__ import annotations

import pytest

from crane_mp.testing.make_model import make_model
from tests.unit.frontend_harness import start_frontend, stop_frontend


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=5)


@pytest.fixture
def server_args():
    return {}


@pytest.fixture
async def frontend(model_dir, tmp_path, server_args):
    client, state, fake = await start_frontend(model_dir, tmp_path, 256, **server_args)
    yield client, state, fake
    await stop_frontend(client, state)
