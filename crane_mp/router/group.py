"""One model of several: a process running that model's own launcher (worker, scheduler and frontend,
the three-process design unchanged), its frontend listening on a Unix socket in the router's private
run directory. The router starts it, learns when it serves, measures what it holds, and stops it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection, wait
from typing import Callable

import msgspec
import psutil

from crane_mp.config import ServerConfig
from crane_mp.protocol import WorkerReady

log = logging.getLogger("crane_mp.router")


class GroupFailed(RuntimeError):
    """The model's processes exited before serving; the message says how, the model's log lines why."""


class ModelGroup:
    def __init__(self, config: ServerConfig, socket_path: str, target: Callable[[ServerConfig, Connection], None]
                 ) -> None:
        """`target(config, conn)`: the model's process (launch.model_group_main), which sends its
        WorkerReady on `conn` once it serves."""
        self.config = dataclasses.replace(config, unix_socket=socket_path)
        self.target = target
        self.socket_path = socket_path
        self.process: mp.Process | None = None
        self.info: WorkerReady | None = None

    async def start(self) -> WorkerReady:
        """Spawn the model's processes and wait until they serve; GroupFailed if they exit first."""
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.process = ctx.Process(target=self.target, args=(self.config, child),
                                   name=f"crane-model-{self.config.model_name}", daemon=False)
        self.process.start()
        child.close()
        log.info("model %s: started its processes (pid %d)", self.config.model_name, self.process.pid)
        try:
            frame = await asyncio.get_running_loop().run_in_executor(None, _ready_frame, parent, self.process)
        finally:
            parent.close()
        if frame is None:
            self.process.join(5)
            raise GroupFailed(f"model {self.config.model_name}: its processes exited with code "
                              f"{self.process.exitcode} while loading (its log lines say why)")
        self.info = msgspec.msgpack.decode(frame, type=WorkerReady)
        return self.info

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def sentinel(self) -> int | None:
        return self.process.sentinel if self.process is not None else None

    async def stop(self, grace: float) -> None:
        """SIGTERM (its requests in flight finish within `grace`), then SIGKILL for what is left."""
        process = self.process
        if process is None:
            return
        if process.is_alive():
            try:
                os.kill(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        await asyncio.get_running_loop().run_in_executor(None, _join_or_kill, process, grace + 15)
        self.process, self.info = None, None
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def resident_bytes(self) -> int:
        """The resident memory of every process of this model (its launcher, worker, scheduler, frontend)."""
        if self.process is None:
            return 0
        return tree_rss(self.process.pid)


def tree_rss(pid: int) -> int:
    total = 0
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return total


def _ready_frame(conn: Connection, process: mp.Process) -> bytes | None:
    """The model's WorkerReady, or None when its processes exit first."""
    while True:
        ready = wait([conn, process.sentinel])
        if conn in ready:
            try:
                return conn.recv_bytes()
            except EOFError:
                return None
        if process.sentinel in ready:
            return None


def _join_or_kill(process: mp.Process, timeout: float) -> None:
    process.join(timeout)
    if process.is_alive():
        log.warning("the %s process did not stop in time; killing its processes", process.name)
        for child in _children(process.pid):
            child.kill()
        process.kill()
        process.join(5)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
