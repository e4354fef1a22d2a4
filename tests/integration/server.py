"""Start the real server (crane-launch, three processes, real sockets) on loopback for a test."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Awaitable, Callable, Iterator, TypeVar

import psutil
import requests

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, model_path: str | Path | None, *args: str, log_path: Path, env: dict | None = None,
                 wait: bool = True, port: int | None = None) -> None:
        """Start crane-launch (on `port`, else a free one); with `wait`, return once /health is 200 (else
        at once, pids unknown)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        model = [] if model_path is None else ["--model-path", str(model_path)]
        cmd = [sys.executable, "-m", "crane_mp", *model, "--port", str(self.port), "--dtype", "float32", *args]
        self.log = open(log_path, "wb")
        # Own session: teardown can kill every process the server started, whatever happened.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=None if env is None else {**os.environ, **env})
        try:
            self.pids = self._wait_ready() if wait else {}
        except BaseException:
            self.kill_all()  # the caller never gets this Server to clean up
            raise

    def _wait_ready(self, stall: float = 90) -> dict[str, int]:
        """Wait for /health while the server makes progress (its log grows or its processes, compilers
        included, use CPU): a slow or busy machine only takes longer; a server that stops progressing for
        `stall` seconds without being ready is a failure."""
        last_progress, last_mark = time.monotonic(), None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or too busy starting to answer
                pass
            mark = (self.log_path.stat().st_size, round(self._cpu_seconds(), 1))
            if mark != last_mark:
                last_progress, last_mark = time.monotonic(), mark
            elif time.monotonic() - last_progress > stall:
                raise RuntimeError(f"server made no progress in {stall}s:\n{self.log_path.read_text()}")
            time.sleep(0.1)
        return {name: int(pid) for name, pid in re.findall(r"started (\S+) process pid=(\d+)", self.log_path.read_text())}

    def _cpu_seconds(self) -> float:
        """CPU time of the server's processes and of the children they have waited for (a compiler)."""
        total = 0.0
        for proc in self.process_tree():
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system + times.children_user + times.children_system
        return total

    def process_tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stats(self) -> dict:
        return requests.get(self.url + "/v1/stats", timeout=10).json()

    @contextmanager
    def paused(self, name: str = "worker") -> Iterator[None]:
        """One of the server's processes frozen (SIGSTOP) until the block ends: no step completes
        meanwhile, so a test acts on a running request however fast the machine makes tokens."""
        proc = psutil.Process(self.pids[name])
        proc.suspend()
        try:
            yield
        finally:
            proc.resume()

    async def all_queued(self, work: Awaitable[T], count: int) -> T:
        """`work`, which sends `count` requests, with the worker frozen until the scheduler holds all of them:
        they compete for KV blocks from the first step on (preemption), however fast the machine is."""
        await self._connect_worker()
        with self.paused("worker"):
            task = asyncio.ensure_future(work)
            await self.queued(count, task)
        return await task

    async def in_waves(self, waves: list[list[Callable[[], T]]]) -> list[T]:
        """Each wave's calls (each sends one request and waits for its answer) made at once, the next
        wave's only once the scheduler holds every request before it, all with the worker frozen: the
        scheduler admits the waves in order and starts them together, however fast the machine is. Two
        requests in the first wave that cannot both finish in the KV budget force a preemption."""
        await self._connect_worker()
        calls = [call for wave in waves for call in wave]
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(len(calls)) as pool:
            futures: list[asyncio.Future[T]] = []
            with self.paused("worker"):
                for wave in waves:
                    futures += [loop.run_in_executor(pool, call) for call in wave]
                    await self.queued(len(futures), asyncio.gather(*futures))
            return list(await asyncio.gather(*futures))

    async def _connect_worker(self) -> None:
        """A one-token request proves the worker's sockets connected: frozen before that, it would leave the
        scheduler blocked in its first send of a step, answering nothing."""
        warm = {"prompt": "warm", "max_tokens": 1}
        ok = await asyncio.to_thread(lambda: requests.post(self.url + "/v1/completions", json=warm, timeout=60).ok)
        assert ok

    async def queued(self, count: int, task: asyncio.Future | None = None, timeout: float = 60) -> None:
        """Returns once the scheduler holds `count` requests (running or waiting), or `task` is done."""
        deadline = time.monotonic() + timeout
        while task is None or not task.done():
            stats = await asyncio.to_thread(self.stats)
            if stats["num_running"] + stats["num_waiting"] >= count:
                return
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.05)

    def wait_idle(self, timeout: float = 60) -> dict:
        """The scheduler's stats once nothing runs or waits (an abort lands within a step)."""
        deadline = time.monotonic() + timeout
        while (stats := self.stats())["num_running"] or stats["num_waiting"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        return stats

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill_all()
        self.log.close()
        return self.proc.returncode

    def kill_all(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
