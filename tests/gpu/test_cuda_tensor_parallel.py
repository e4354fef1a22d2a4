"""--tensor-parallel-size 2 on NCCL: the same greedy tokens as one GPU, each rank on its own device,
and a rank's death stopping the server. Skipped with fewer than two CUDA devices."""

from __future__ import annotations

import signal
import time

import psutil
import pytest
import requests
import torch

from crane_mp.testing.make_model import make_model
from tests.integration.server import Server
from tests.integration.test_tensor_parallel import prompts, served

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3", "small", tmp_path_factory.mktemp("m") / "qwen3", seed=1)


def test_two_gpus_serve_one_gpus_tokens(model_dir, tmp_path):
    tokens = {}
    for tp in (1, 2):
        srv = Server(model_dir, "--tensor-parallel-size", str(tp), log_path=tmp_path / f"tp{tp}.log")
        try:
            tokens[tp] = served(srv.url, prompts())
            info = requests.get(srv.url + "/server_info", timeout=10).json()
            assert [r["device"] for r in info["ranks"]] == [f"Cuda({r})" for r in range(tp)]
        finally:
            assert srv.stop() == 0
    assert tokens[2] == tokens[1]


def test_a_killed_rank_stops_the_server(model_dir, tmp_path):
    srv = Server(model_dir, "--tensor-parallel-size", "2", log_path=tmp_path / "log")
    try:
        killed = time.monotonic()
        psutil.Process(srv.pids["worker-1"]).send_signal(signal.SIGKILL)
        assert srv.proc.wait(10) != 0 and time.monotonic() - killed < 10
    finally:
        srv.kill_all()
