"""Running it as a service: config files, load shedding, timeouts, fault isolation, access logs,
request ids, several frontends, systemd's notify protocol and unit file, clean stops."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil
import pytest
import requests

from crane_mp.testing.make_model import make_model
from tests.integration.server import Server

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
FAULT_TOKEN = 7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3", seed=5)


def access_lines(log_path: Path) -> list[dict]:
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line["logger"] == "crane_mp.access"]


def stopped_cleanly(srv: Server) -> str:
    """The server's log after a SIGTERM stop that exited 0."""
    assert srv.stop() == 0
    return srv.log_path.read_text()


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_starts_the_server(model_dir, tmp_path, config):
    # On a host without a GPU the GPU files serve on CPU (their limits then bound host RAM); the demo
    # file serves the demo model, the others the model given on the command line, which outranks them.
    text = config.read_text()
    srv = Server(None if "demo = true" in text else model_dir, "--config", str(config),
                 "--host", "127.0.0.1", log_path=tmp_path / "log")
    try:
        info = requests.get(srv.url + "/server_info", timeout=30).json()
        settings = info["settings"]
        assert settings["max-concurrent"]["source"] == f"file {config}"
        assert settings["port"]["source"] == "cli" and settings["host"]["source"] == "cli"
        r = requests.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    finally:
        assert "Traceback" not in stopped_cleanly(srv)


def test_a_typo_in_a_config_key_stops_start_up_with_one_line(model_dir, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('max-concurent = 8\n')
    result = subprocess.run([sys.executable, "-m", "crane_mp", "--model-path", str(model_dir), "--config", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"crane-launch: error: config file {bad}: unknown key 'max-concurent' (did you mean 'max-concurrent'?)"]


def test_environment_sits_between_the_file_and_the_flags(model_dir, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('max-queue = 5\nmax-concurrent = 4\nrequest-timeout = 50\n')
    srv = Server(model_dir, "--config", str(config), "--max-concurrent", "6", log_path=tmp_path / "log",
                 env={"CRANE_MAX_QUEUE": "7", "CRANE_MAX_CONCURENT": "9"})
    try:
        settings = requests.get(srv.url + "/server_info", timeout=30).json()["settings"]
        assert settings["max-queue"] == {"value": 7, "source": "env CRANE_MAX_QUEUE"}
        assert settings["max-concurrent"] == {"value": 6, "source": "cli"}
        assert settings["request-timeout"] == {"value": 50.0, "source": f"file {config}"}
        assert settings["block-size"] == {"value": 16, "source": "default"}
    finally:
        log = stopped_cleanly(srv)
    assert "CRANE_MAX_CONCURENT names no crane-launch setting" in log


async def _post(session, url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, str]:
    async with session.post(url, json=body, headers=headers) as r:
        return r.status, {key.lower(): value for key, value in r.headers.items()}, await r.text()


def test_overload_sheds_with_429_and_every_accepted_request_completes(model_dir, tmp_path):
    srv = Server(model_dir, "--max-concurrent", "4", "--max-queue", "8", log_path=tmp_path / "log")
    try:
        procs = [psutil.Process(pid) for pid in srv.pids.values()]
        requests.post(srv.url + "/v1/completions", json={"prompt": "warm", "max_tokens": 4}, timeout=60)

        async def burst():
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                bodies = [{"prompt": f"load {i}", "max_tokens": 400, "ignore_eos": True, "stream": i % 2 == 0}
                          for i in range(300)]
                with srv.paused("worker"):  # nothing finishes before the queue overflows, on any machine
                    posts = [asyncio.ensure_future(_post(session, srv.url + "/v1/completions", b)) for b in bodies]
                    for first_done in asyncio.as_completed(posts):
                        if (await first_done)[0] == 429:
                            break
                return await asyncio.gather(*posts)

        rss_before = [p.memory_info().rss for p in procs]
        results = asyncio.run(burst())
        statuses = [status for status, _, _ in results]
        assert set(statuses) == {200, 429}, set(statuses)
        for status, headers, text in results:
            if status == 429:
                assert headers["retry-after"] == "1"
                assert json.loads(text)["error"]["type"] == "rate_limit_error"
            elif text.startswith("data:"):
                assert text.endswith("data: [DONE]\n\n") and '"error"' not in text
            else:
                assert json.loads(text)["usage"]["completion_tokens"] == 400
        assert statuses.count(200) >= 4 + 8 and statuses.count(429) >= 1
        stats = srv.stats()
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["num_free_blocks"] + stats["num_cached_blocks"] >= stats["num_total_blocks"] - 1
        metrics = requests.get(srv.url + "/metrics", timeout=30).text
        replica = f"127.0.0.1:{srv.port}"
        assert (f'crane:requests_rejected_total{{model_name="qwen3",replica="{replica}"}} '
                f'{float(statuses.count(429))}') in metrics
        assert requests.get(srv.url + "/health", timeout=30).status_code == 200
        for before, proc in zip(rss_before, procs):
            assert proc.memory_info().rss < before * 1.10, proc.name()
    finally:
        stopped_cleanly(srv)


def test_a_request_that_makes_the_worker_raise_fails_alone(model_dir, tmp_path):
    srv = Server(model_dir, "--log-format", "json", log_path=tmp_path / "log",
                 env={"CRANE_MP_FAULT_TOKEN": str(FAULT_TOKEN)})
    try:
        async def scenario():
            async with aiohttp.ClientSession() as session:
                streams = [_post(session, srv.url + "/v1/completions",
                                 {"prompt": [11, 12, 13 + i], "max_tokens": 40, "ignore_eos": True, "stream": True})
                           for i in range(8)]
                bad = _post(session, srv.url + "/v1/completions", {"prompt": [11, FAULT_TOKEN, 12], "max_tokens": 40},
                            headers={"X-Request-Id": "poisoned-1"})
                return await asyncio.gather(bad, *streams)

        (status, headers, text), *streams = asyncio.run(scenario())
        assert status == 500 and headers["x-request-id"] == "poisoned-1"
        message = json.loads(text)["error"]["message"]
        assert "internal error in the model worker" in message and "request id poisoned-1" in message
        assert "fault injected" not in message  # the exception's text stays in the server log
        for status, _, text in streams:
            chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            assert status == 200 and chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 1 and '"error"' not in text
        after = requests.post(srv.url + "/v1/completions", json={"prompt": [11, 12], "max_tokens": 3}, timeout=60)
        assert after.status_code == 200 and srv.stats()["num_running"] == 0
    finally:
        log = stopped_cleanly(srv)
    failures = [json.loads(line) for line in log.splitlines()
                if line.startswith("{") and "failed in the worker" in line]
    assert failures and "RuntimeError: fault injected" in failures[0]["traceback"]


def test_access_log_request_ids_and_two_frontends(model_dir, tmp_path):
    srv = Server(model_dir, "--num-frontends", "2", "--log-format", "json", log_path=tmp_path / "log")
    secret = "zebra-unicorn-marker"
    try:
        async def workload():
            async with aiohttp.ClientSession() as session:
                calls = []
                for i in range(12):  # a new connection each: the kernel spreads them over both frontends
                    calls.append(_post(session, srv.url + "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": f"{secret} {i}"}], "max_tokens": 3,
                                        "ignore_eos": True},
                                       headers={"X-Request-Id": f"chat-{i}", "Connection": "close"}))
                    calls.append(_post(session, srv.url + "/generate",
                                       {"text": f"{secret} {i}", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
                                       headers={"Connection": "close"}))
                calls.append(_post(session, srv.url + "/v1/completions", {"prompt": secret, "max_tokens": -1},
                                   headers={"X-Request-Id": "bad-1"}))
                return await asyncio.gather(*calls)

        results = asyncio.run(workload())
        assert [s for s, _, _ in results].count(200) == 24 and results[-1][0] == 400
        assert results[0][1]["x-request-id"] == "chat-0" and len(results[1][1]["x-request-id"]) == 32
        metrics = requests.get(srv.url + "/metrics", timeout=30).text
        assert ('vllm:request_success_total{finished_reason="length",model_name="qwen3",'
                f'replica="127.0.0.1:{srv.port}"}} 24.0') in metrics
    finally:
        log = stopped_cleanly(srv)
    lines = [line for line in access_lines(srv.log_path) if line["route"] != "/metrics"]
    assert len(lines) == 25 and secret not in log
    chat = next(line for line in lines if line["request_id"] == "chat-3")
    assert chat["route"] == "/v1/chat/completions" and chat["status"] == 200 and chat["model"] == "qwen3"
    assert chat["completion_tokens"] == 3 and chat["prompt_tokens"] > 3 and chat["finish_reason"] == "length"
    assert chat["ttft"] is not None and chat["total_time"] >= chat["ttft"] and chat["queue_time"] is not None
    assert chat["cached_tokens"] >= 0
    bad = next(line for line in lines if line["request_id"] == "bad-1")
    assert bad["status"] == 400 and bad["prompt_tokens"] == 0
    assert len({line["pid"] for line in lines}) == 2


def test_openai_ids_abort_and_request_timeout(model_dir, tmp_path):
    srv = Server(model_dir, "--request-timeout", "1", "--log-requests", log_path=tmp_path / "log")
    try:
        async def scenario():
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "long", "max_tokens": 1900, "ignore_eos": True, "stream": True}
                async with session.post(srv.url + "/v1/completions", json=body) as r:
                    first = json.loads((await r.content.readline())[6:])
                    with srv.paused("worker"):  # still running when the abort lands
                        aborted = await session.post(srv.url + "/abort_request", json={"rid": first["id"]})
                        assert aborted.status == 200
                    rest = (await r.read()).decode()
                with srv.paused("worker"):  # no token at all within the 1 s limit
                    return rest, await _post(session, srv.url + "/v1/completions",
                                             {"prompt": "long", "max_tokens": 1900, "ignore_eos": True})

        rest, (status, _, text) = asyncio.run(scenario())
        assert '"finish_reason":"abort"' in rest.replace(" ", "") and rest.endswith("data: [DONE]\n\n")
        assert status == 408 and "--request-timeout" in json.loads(text)["error"]["message"]
        srv.wait_idle()  # the timed-out request was aborted in the engine too
    finally:
        log = stopped_cleanly(srv)
    assert "prompt=long" in log  # --log-requests


def test_systemd_notify_ready_watchdog_stopping_and_a_clean_stop(model_dir, tmp_path):
    notify_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        notify.settimeout(120)
        env = {"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "2000000"}
        srv = Server(model_dir, log_path=tmp_path / "log", env=env, wait=False)
        try:
            assert notify.recv(4096).decode().startswith("READY=1\n")
            assert requests.get(srv.url + "/health", timeout=10).status_code == 200
            assert notify.recv(4096).decode() == "WATCHDOG=1"
            assert notify.recv(4096).decode() == "WATCHDOG=1"
            srv.proc.send_signal(signal.SIGTERM)
            while (message := notify.recv(4096).decode()) == "WATCHDOG=1":
                pass
            assert message == "STOPPING=1"
            assert srv.proc.wait(60) == 0
        finally:
            srv.kill_all()
            srv.log.close()
    log = srv.log_path.read_text()
    assert "Warning" not in log and "leaked" not in log and "did not stop in time" not in log


def test_after_a_child_dies_the_others_stop_on_request(model_dir, tmp_path):
    srv = Server(model_dir, log_path=tmp_path / "log")
    try:
        psutil.Process(srv.pids["worker"]).send_signal(signal.SIGKILL)
        assert srv.proc.wait(30) == 1
    finally:
        srv.kill_all()
        srv.log.close()
    log = srv.log_path.read_text()
    assert "did not stop in time" not in log and "leaked" not in log
    assert "stopped scheduler process" in log and "stopped frontend process" in log


@pytest.mark.parametrize("name", ["crane-mp.service", "crane-mp-worker-node.service"])
def test_the_unit_file_passes_systemd_analyze_verify(tmp_path, name):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    unit = tmp_path / name
    launcher = Path(sys.executable).with_name("crane-launch")
    text = (ROOT / "launch" / name).read_text()
    assert "/opt/crane-mp/venv/bin/crane-launch" in text
    # verify checks that ExecStart's binary exists: point it at this environment's.
    unit.write_text(text.replace("/opt/crane-mp/venv/bin/crane-launch", str(launcher)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert name not in result.stderr, result.stderr
    stop_timeout = next(int(line.split("=")[1]) for line in text.splitlines() if line.startswith("TimeoutStopSec="))
    assert stop_timeout >= 30 + 15  # the default --shutdown-grace plus the children's stop time


@pytest.mark.slow
def test_a_frontend_that_dies_is_started_again_while_the_other_serves(model_dir, tmp_path):
    srv = Server(model_dir, "--num-frontends", "2", log_path=tmp_path / "log")
    try:
        victim = psutil.Process(srv.pids["frontend-1"])
        victim.kill()
        victim.wait(30)
        for _ in range(4):  # served meanwhile: the kernel sends new connections to the live frontend
            r = requests.post(srv.url + "/v1/completions", json={"prompt": [11, 12], "max_tokens": 3}, timeout=60)
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 120
        while "the frontend-1 process serves again" not in srv.log_path.read_text():
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.log_path.read_text()
            time.sleep(0.1)
        for _ in range(8):
            r = requests.post(srv.url + "/v1/completions", json={"prompt": [11, 12], "max_tokens": 3}, timeout=60)
            assert r.status_code == 200, r.text
        assert requests.get(srv.url + "/health", timeout=30).status_code == 200
    finally:
        log = stopped_cleanly(srv)
    assert "frontend-1 process exited with code -9; starting it again" in log


def test_a_launcher_killed_outright_takes_its_children_with_it(model_dir, tmp_path):
    """SIGKILL leaves crane-launch no time to stop anything: its children go with it (no frontend left
    holding the port and answering), and the port takes a new server at once."""
    srv = Server(model_dir, log_path=tmp_path / "log")
    try:
        children = [psutil.Process(pid) for pid in srv.pids.values()]
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(30)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.name() for p in alive]
        again = Server(model_dir, log_path=tmp_path / "again.log", port=srv.port)
        assert again.stop() == 0
    finally:
        srv.kill_all()
        srv.log.close()
