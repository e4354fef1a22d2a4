"""crane-launch: parse flags, spawn worker, scheduler and frontend, wait for readiness, supervise.

Start-up: worker and frontend start together (weights and tokenizer load in parallel; HTTP answers
503 meanwhile); the scheduler starts once the worker reports its KV block count; the frontend is
handed the engine facts and reports ready; then one summary line and systemd's READY=1.
Supervision: any child dying stops the others and exits non-zero. SIGTERM/SIGINT drain: the
frontend refuses new work and lets in-flight requests finish within --shutdown-grace, then the
scheduler (which stops the worker) and the worker are stopped in that order; exit 0.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait

import msgspec

from crane_mp.cli import parse_args
from crane_mp.config import ServerConfig
from crane_mp.entrypoints import frontend_main, scheduler_main, worker_main
from crane_mp.ipc import Addresses
from crane_mp.protocol import WorkerReady
from crane_mp.scheduler.scheduler import SchedulerConfig
from crane_mp.systemd import notify

log = logging.getLogger("crane_mp.launch")


class ChildDied(RuntimeError):
    pass


class Launcher:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.run_dir = tempfile.mkdtemp(prefix="crane-mp-")  # mode 0700: only we reach the sockets
        self.addresses = Addresses(self.run_dir)
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.Process] = {}
        self.stop_requested = False

    def _spawn(self, name: str, target, *args) -> Connection:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=target, args=(*args, child), name=f"crane-{name}", daemon=False)
        proc.start()
        child.close()
        self.procs[name] = proc
        log.info("started %s process pid=%d", name, proc.pid)
        return parent

    def _await(self, conn: Connection, what: str, timeout: float = 3600.0) -> bytes:
        """Wait for a message on `conn` while watching every child; a death or signal aborts start-up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.stop_requested:
                raise KeyboardInterrupt
            ready = wait([conn] + [p.sentinel for p in self.procs.values()], timeout=0.2)
            if conn in ready:
                try:
                    return conn.recv_bytes()
                except EOFError:
                    pass
            for name, proc in self.procs.items():
                if not proc.is_alive():
                    raise ChildDied(f"the {name} process exited with code {proc.exitcode} while {what}")
        raise ChildDied(f"timed out while {what}")

    def start(self) -> WorkerReady:
        cfg = self.config
        worker_conn = self._spawn("worker", worker_main, cfg.engine, self.addresses, cfg.log_level)
        frontend_conn = self._spawn("frontend", frontend_main, cfg, self.addresses, 0)
        self._await(frontend_conn, "the frontend was binding its port")
        info = msgspec.msgpack.decode(self._await(worker_conn, "the worker was loading the model"), type=WorkerReady)
        sched_cfg = SchedulerConfig(
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            max_num_seqs=cfg.engine.max_num_seqs,
            max_num_batched_tokens=cfg.engine.max_num_batched_tokens,
            max_model_len=info.max_model_len,
            eos_token_ids=tuple(info.eos_token_ids),
            enable_prefix_caching=cfg.engine.enable_prefix_caching,
            warm_blocks_first=info.device == "Cpu",
        )
        sched_conn = self._spawn(
            "scheduler", scheduler_main, sched_cfg, self.addresses, cfg.num_frontends, cfg.engine.overlap_schedule,
            cfg.log_level,
        )
        self._await(sched_conn, "the scheduler was starting")
        frontend_conn.send_bytes(msgspec.msgpack.encode(info))
        self._await(frontend_conn, "the frontend was connecting")
        return info

    def supervise(self) -> int:
        """Block until a child dies (exit 1) or a stop signal arrives (drain, exit 0)."""
        while not self.stop_requested:
            wait([p.sentinel for p in self.procs.values()], timeout=0.2)
            for name, proc in self.procs.items():
                if not proc.is_alive():
                    log.error("the %s process exited with code %s; stopping the server", name, proc.exitcode)
                    self.fail()
                    return 1
        notify("STOPPING=1")
        log.info("draining: finishing in-flight requests (up to %.0f s)", self.config.shutdown_grace)
        self._stop("frontend", self.config.shutdown_grace + 5)
        self._stop("scheduler", 5)
        self._stop("worker", 5)
        return 0

    def fail(self) -> None:
        """An engine process died: end every open request with an error, then stop everything."""
        frontend = self.procs.get("frontend")
        if frontend is not None and frontend.is_alive():
            signal_process(frontend, signal.SIGUSR1)
            frontend.join(0.5)
        for name in ("frontend", "scheduler", "worker"):
            self._stop(name, 1.0)

    def _stop(self, name: str, timeout: float) -> None:
        proc = self.procs.get(name)
        if proc is None or not proc.is_alive():
            return
        started = time.monotonic()
        signal_process(proc, signal.SIGTERM)
        proc.join(timeout)
        if proc.is_alive():
            log.warning("the %s process did not stop in time; killing it", name)
            proc.kill()
            proc.join(2)
        log.info("stopped %s process in %.1f s", name, time.monotonic() - started)

    def cleanup(self) -> None:
        for name in list(self.procs):
            self._stop(name, 1.0)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def signal_process(proc: mp.Process, signum: int) -> None:
    try:
        os.kill(proc.pid, signum)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    launcher = Launcher(config)

    def request_stop(signum, frame) -> None:
        launcher.stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    code = 1
    try:
        info = launcher.start()
        gib = 1 << 30
        log.info(
            "weights: format=%s %.3f GiB in memory (%.3f GiB in the file)%s",
            info.model_format, info.weights_bytes / gib, info.weights_file_bytes / gib,
            f" types: {info.weight_types}" if info.weight_types else "",
        )
        log.info(
            "ready in %.1f s: model=%s arch=%s device=%s dtype=%s isa=%s kernels=%s kv_bytes=%d/token "
            "kv_budget=%.2f GiB blocks=%d (%d tokens) max_concurrent=%d max_model_len=%d prefix_cache=%s overlap=%s "
            "listening on http://%s:%d",
            time.monotonic() - started, config.model_name, info.arch, info.device, info.dtype, info.isa,
            info.kernel_isa, info.kv_bytes_per_token, info.kv_budget_bytes / gib, info.num_blocks,
            info.num_blocks * info.block_size, config.engine.max_num_seqs, info.max_model_len, _on_off(config.engine.enable_prefix_caching),
            _on_off(config.engine.overlap_schedule), config.host, config.port,
        )
        notify("READY=1")
        code = launcher.supervise()
    except KeyboardInterrupt:
        code = 0
    except ChildDied as err:
        log.error("start-up failed: %s", err)
        code = 1
    finally:
        launcher.cleanup()
    sys.exit(code)
