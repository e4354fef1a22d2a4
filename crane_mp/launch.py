"""crane-launch: parse flags, spawn worker, scheduler and frontend, wait for readiness, supervise.

Start-up: worker and frontends start together (weights and tokenizers load in parallel; HTTP
answers 503 meanwhile); the scheduler starts once the worker reports its KV block count; the
frontends are handed the engine facts and report ready; then one summary line and systemd's READY=1.
Supervision: a frontend that dies is started again (the others keep serving; the scheduler aborts
what its last life left), at most _FRONTEND_RESTARTS times; the worker or scheduler dying stops the
others and exits non-zero. Under systemd's watchdog the launcher pings WATCHDOG=1 while the pipeline
answers (watchdog.py). SIGTERM/SIGINT drain: the
frontends refuse new work and let in-flight requests finish within --shutdown-grace, then the
scheduler (which stops the worker) and the worker are stopped in that order; exit 0.
"""

from __future__ import annotations

import ipaddress
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from typing import Callable

import msgspec

from crane_mp.cli import parse_args
from crane_mp.config import ServerConfig
from crane_mp.entrypoints import die_with_launcher, frontend_main, name_process, scheduler_main, worker_main
from crane_mp.ipc import Addresses
from crane_mp.logs import configure_logging
from crane_mp.protocol import WorkerReady
from crane_mp.router.command import model_set
from crane_mp.scheduler.scheduler import SchedulerConfig, scheduler_config
from crane_mp.systemd import notify
from crane_mp.watchdog import Watchdog

log = logging.getLogger("crane_mp.launch")


class ChildDied(RuntimeError):
    pass


# Restarts of one frontend before its death is taken for a fault that restarting will not cure.
_FRONTEND_RESTARTS = 5


class Launcher:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.run_dir = tempfile.mkdtemp(prefix="crane-mp-")  # mode 0700: only we reach the sockets
        self.addresses = Addresses(self.run_dir)
        self.metrics_dir = os.path.join(self.run_dir, "metrics")
        os.mkdir(self.metrics_dir)
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.Process] = {}
        self.stop_requested = False
        self.info: WorkerReady | None = None  # the engine facts every frontend (and a restarted one) gets
        self.scheduler_config: SchedulerConfig | None = None  # what the scheduler runs by (the start-up line's)
        self.lives: dict[str, int] = {}  # frontend -> how many times it was started again

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

    @property
    def frontends(self) -> list[str]:
        return [name for name in self.procs if name.startswith("frontend")]

    @property
    def workers(self) -> list[str]:
        return [name for name in self.procs if name.startswith("worker")]

    def _spawn_workers(self) -> list[Connection]:
        """This node's worker ranks: rank 0 is "worker" (the scheduler's), rank r "worker-r"."""
        cfg = self.config
        return [self._spawn("worker" if rank == 0 else f"worker-{rank}", worker_main, cfg.engine, self.addresses,
                            cfg.logs, rank)
                for rank in cfg.engine.parallel.local_ranks]

    def start(self) -> WorkerReady:
        cfg = self.config
        worker_conns = self._spawn_workers()
        frontend_conns = [self._spawn_frontend(i, 0) for i in range(cfg.num_frontends)]
        for conn in frontend_conns:
            self._await(conn, "the frontend was binding its port")
        info = msgspec.msgpack.decode(self._await(worker_conns[0], "the worker was loading the model"),
                                      type=WorkerReady)
        for conn in worker_conns[1:]:
            self._await(conn, "the worker ranks were loading the model")
        sched_cfg = scheduler_config(
            cfg.engine, info.num_blocks, info.max_model_len, tuple(info.eos_token_ids), on_cpu=info.device_type == "cpu",
            max_queue=cfg.max_queue, prefill_seconds_per_token=info.prefill_seconds_per_token,
            whole_prompts=info.whole_prompts, kv_windows=tuple(info.kv_windows), state_slots=info.state_slots,
            whole_images=info.whole_images,
        )
        sched_conn = self._spawn(
            "scheduler", scheduler_main, sched_cfg, self.addresses, cfg.num_frontends, cfg.engine.overlap_schedule,
            cfg.logs,
        )
        self._await(sched_conn, "the scheduler was starting")
        self.scheduler_config = sched_cfg
        for conn in frontend_conns:
            conn.send_bytes(msgspec.msgpack.encode(info))
        for conn in frontend_conns:
            self._await(conn, "the frontend was connecting")
        self.info = info
        return info

    def start_worker_node(self) -> None:
        """A node past the first (--node-rank above 0): its worker ranks only, which join node 0's."""
        for conn in self._spawn_workers():
            self._await(conn, "the worker ranks were loading the model")

    def _spawn_frontend(self, index: int, life: int) -> Connection:
        name = _frontend_name(index, self.config.num_frontends)
        self.lives[name] = life
        return self._spawn(name, frontend_main, self.config, self.addresses, index, life, self.metrics_dir)

    def _restart_frontend(self, name: str) -> bool:
        """Start a dead frontend again and wait for it to serve; False when it may not be restarted."""
        life = self.lives[name] + 1
        if life > _FRONTEND_RESTARTS:
            return False
        index = int(name.rpartition("-")[2]) if "-" in name else 0
        conn = self._spawn_frontend(index, life)
        self._await(conn, f"the restarted {name} was binding its port")
        conn.send_bytes(msgspec.msgpack.encode(self.info))
        self._await(conn, f"the restarted {name} was connecting")
        log.info("the %s process serves again (restart %d of at most %d)", name, life, _FRONTEND_RESTARTS)
        return True

    def supervise(self, watchdog: Watchdog | None = None) -> int:
        """Block until a child dies (exit 1) or a stop signal arrives (drain, exit 0)."""
        while not self.stop_requested:
            wait([p.sentinel for p in self.procs.values()], timeout=0.2)
            for name, proc in list(self.procs.items()):
                if proc.is_alive() or self.stop_requested:
                    continue
                if name in self.frontends:
                    log.error("the %s process exited with code %s; starting it again", name, proc.exitcode)
                    try:
                        if self._restart_frontend(name):
                            continue
                    except ChildDied as err:
                        log.error("%s", err)
                    log.error("the %s process cannot be kept running; stopping the server", name)
                else:
                    log.error("the %s process exited with code %s; stopping the server", name, proc.exitcode)
                self.fail()
                return 1
            if watchdog is not None:
                watchdog.tick()
        notify("STOPPING=1")
        log.info("draining: finishing in-flight requests (up to %.0f s)", self.config.shutdown_grace)
        self._stop(self.frontends, self.config.shutdown_grace + 5)
        self._stop(["scheduler"], 5)
        self._stop(self.workers, 5)
        return 0

    def supervise_worker_node(self) -> int:
        """Until this node's ranks end: 0 when all of them left cleanly (node 0 stopped the model), else
        1, the others stopped at once; a stop signal stops them all (exit 0)."""
        while not self.stop_requested:
            wait([p.sentinel for p in self.procs.values()], timeout=0.2)
            ended = [proc for proc in self.procs.values() if not proc.is_alive()]
            failed = [(name, proc.exitcode) for name, proc in self.procs.items()
                      if not proc.is_alive() and proc.exitcode != 0]
            if failed:
                for name, code in failed:
                    log.error("the %s process exited with code %s; stopping this node's ranks", name, code)
                self._stop(self.workers, 5.0)
                return 1
            if len(ended) == len(self.procs):
                log.info("node 0 stopped the model; this node's ranks have left")
                return 0
        self._stop(self.workers, 5.0)
        return 0

    def fail(self) -> None:
        """An engine process died: end every open request with an error, then stop everything."""
        alive = [self.procs[name] for name in self.frontends if self.procs[name].is_alive()]
        for proc in alive:
            signal_process(proc, signal.SIGUSR1)
        for proc in alive:
            proc.join(0.5)
        self._stop([*self.frontends, "scheduler", *self.workers], 5.0)

    def _stop(self, names: list[str], timeout: float) -> None:
        """SIGTERM each of `names` at once, wait up to `timeout` for all, kill what is left."""
        procs = {name: self.procs[name] for name in names if name in self.procs and self.procs[name].is_alive()}
        started = time.monotonic()
        for proc in procs.values():
            signal_process(proc, signal.SIGTERM)
        for name, proc in procs.items():
            proc.join(max(0.0, started + timeout - time.monotonic()))
            if proc.is_alive():
                log.warning("the %s process did not stop in time; killing it", name)
                proc.kill()
                proc.join(2)
            log.info("stopped %s process in %.1f s", name, time.monotonic() - started)

    def cleanup(self) -> None:
        self._stop(list(self.procs), 5.0)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _frontend_name(index: int, count: int) -> str:
    return "frontend" if count == 1 else f"frontend-{index}"


def _described_arch(info: WorkerReady) -> str:
    """The architecture, and when transformers' modeling code runs it, say so: it is slower than native."""
    if info.model_impl == "transformers":
        return f"{info.hf_model_type}(transformers backend: slower than native)"
    return info.arch


def _kv_bytes(info: WorkerReady) -> str:
    """KV bytes a token keeps; with sliding layers in KV groups of their own, past their windows and within."""
    if len(info.kv_windows) == 1:
        return f"{info.kv_bytes_per_token}/token"
    window = max(info.kv_windows)
    return (f"{info.kv_bytes_per_long_token}/token past the {window}-token sliding windows "
            f"({info.kv_bytes_per_token * len(info.kv_windows)}/token within)")


def _state_pool(info: WorkerReady) -> str:
    """A hybrid model's state pool, for the start-up line ("" without one)."""
    if not info.state_slots:
        return ""
    return (f" state_pool={_mib(info.state_slots * info.state_bytes_per_seq)} ({info.state_slots} sequences of "
            f"{_mib(info.state_bytes_per_seq)})")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.{1 if num_bytes >= 1 << 20 else 3}f} MiB"


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def exposure_warnings(config: ServerConfig) -> list[str]:
    """What an operator should know about who can reach this server and change it."""
    warnings = []
    if not _loopback(config.host) and not (config.api_key or config.admin_api_key):
        warnings.append(f"listening on {config.host} without --api-key: anyone who can reach the port can use "
                        "this server")
    engine = config.engine
    if engine.runtime_lora and not (config.admin_api_key or config.api_key):
        warnings.append(f"run-time LoRA loading from {engine.lora_root} is open to every client: set --admin-api-key")
    return warnings


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def signal_process(proc: mp.Process, signum: int) -> None:
    try:
        os.kill(proc.pid, signum)
    except ProcessLookupError:
        pass


def describe_parallel(info: WorkerReady) -> str:
    """tp=2 nodes=1 ranks: 0 node0 Cpu(cores 0-0) weights 1.2 MiB, 1 node0 ..."""
    ranks = ", ".join(f"{r.rank} node{r.node} {r.device} weights {r.weights_bytes / 2**20:.1f} MiB" for r in info.ranks)
    return f"tp={info.tensor_parallel_size} nodes={info.nnodes} ranks: {ranks}"


def _run_worker_node(launcher: Launcher, started: float) -> int:
    """--node-rank above 0: this host's worker ranks only; the HTTP frontends and the scheduler are node 0's."""
    parallel = launcher.config.engine.parallel
    code = 1
    try:
        launcher.start_worker_node()
        log.info("worker node %d ready in %.1f s: ranks %s of tp=%d, joined at %s", parallel.node_rank,
                 time.monotonic() - started, ", ".join(map(str, parallel.local_ranks)),
                 parallel.tensor_parallel_size, parallel.dist_init_addr)
        notify(f"READY=1\nSTATUS=worker node {parallel.node_rank}")
        code = launcher.supervise_worker_node()
    except KeyboardInterrupt:
        code = 0
    except ChildDied as err:
        log.error("start-up failed: %s", err)
    finally:
        launcher.cleanup()
    log.info("stopped (exit code %d)", code)
    return code


def main(argv: list[str] | None = None) -> None:
    models = model_set(argv)
    if models is not None:
        configure_logging(models.public.logs)
        from crane_mp.router.serve import run_router

        sys.exit(run_router(models, model_group_main))
    config = parse_args(argv)
    configure_logging(config.logs)
    for name in config.unknown_env:
        log.warning("environment variable %s names no crane-launch setting; ignored", name)
    for warning in exposure_warnings(config):
        log.warning("%s", warning)
    code = serve_model(config, lambda info: notify("READY=1\nSTATUS=serving " + config.model_name),
                       Watchdog.from_environment(config))
    # Every process is stopped and the run directory gone: the interpreter's teardown serves nothing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve_model(config: ServerConfig, on_ready: Callable[[WorkerReady], None], watchdog: Watchdog | None) -> int:
    """One model's processes from start to stop; `on_ready` once they serve. Returns the exit code."""
    started = time.monotonic()
    launcher = Launcher(config)

    def request_stop(signum, frame) -> None:
        launcher.stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    code = 1
    if config.engine.parallel.node_rank > 0:
        return _run_worker_node(launcher, started)
    try:
        info = launcher.start()
        gib = 1 << 30
        log.info(
            "weights: format=%s %.3f GiB in memory (%.3f GiB in the file)%s",
            info.model_format, info.weights_bytes / gib, info.weights_file_bytes / gib,
            f" types: {info.weight_types}" if info.weight_types else "",
        )
        log.info(
            "ready in %.1f s: model=%s arch=%s device=%s dtype=%s kv_dtype=%s activations=%s isa=%s kernels=%s "
            "kv_bytes=%s "
            "kv_budget=%.2f GiB blocks=%d (%d tokens)%s max_concurrent=%d max_queue=%d max_model_len=%d "
            "prefix_cache=%s overlap=%s runtime_lora=%s frontends=%d listening on %s",
            time.monotonic() - started, config.model_name, _described_arch(info), info.device, info.dtype,
            info.kv_cache_dtype, info.quantized_activations, info.isa,
            info.kernel_isa, _kv_bytes(info), info.kv_budget_bytes / gib, info.num_blocks,
            info.num_blocks * info.block_size, _state_pool(info), launcher.scheduler_config.max_num_seqs,
            config.max_queue, info.max_model_len, _on_off(launcher.scheduler_config.enable_prefix_caching),
            _on_off(config.engine.overlap_schedule),
            _on_off(config.engine.runtime_lora), config.num_frontends,
            f"unix:{config.unix_socket}" if config.unix_socket else f"http://{config.host}:{config.port}",
        )
        if info.tensor_parallel_size > 1:
            log.info("parallel: %s", describe_parallel(info))
        engine = config.engine
        if engine.speculative_method is not None:
            draft = f" draft={engine.speculative_model}" if engine.speculative_model else ""
            log.info("speculative decoding: %s%s, up to %d tokens a step, off above %d running requests",
                     engine.speculative_method, draft, engine.speculative_num_tokens,
                     engine.speculative_disable_batch_size)
        if info.state_slots and config.engine.enable_prefix_caching:
            log.info("prefix cache off: %s's linear-attention layers keep a recurrent state per sequence, which "
                     "a cached prefix's KV blocks do not hold", info.arch)
        on_ready(info)
        code = launcher.supervise(watchdog)
    except KeyboardInterrupt:
        code = 0
    except ChildDied as err:
        log.error("start-up failed: %s", err)
        code = 1
    finally:
        launcher.cleanup()
    log.info("stopped (exit code %d)", code)
    return code


def model_group_main(config: ServerConfig, conn: Connection) -> None:
    """One model of several (router/group.py): its own worker, scheduler and frontend under a launcher
    of its own, which tells the router, not systemd, once it serves, and drains on SIGTERM."""
    die_with_launcher()
    name_process("crane-model")
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(name, None)
    if config.cuda_devices is not None:  # before its worker imports torch: the devices it may see
        os.environ["CUDA_VISIBLE_DEVICES"] = config.cuda_devices
    configure_logging(config.logs)
    sys.exit(serve_model(config, lambda info: conn.send_bytes(msgspec.msgpack.encode(info)), None))
