"""Worker process: loads the model, reports WorkerReady, then executes StepPlans until told to stop.

Sockets live only here and in the background jobs (background.py); the runner does the work. A
request whose processing raises is failed by the runner alone (runner.py); any other exception is an
engine fault: the process exits non-zero and the launcher stops the server.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from functools import partial
from multiprocessing.connection import Connection

import psutil
import torch
import zmq
from tqdm import tqdm

from crane_mp.config import EngineConfig
from crane_mp.heap import malloc_trim
from crane_mp.ipc import Addresses, encode, make_socket, worker_decoder
from crane_mp.logs import LogSettings, configure_logging
from crane_mp.models.config import UnsupportedModelError
from crane_mp.models.registry import TRANSFORMERS
from crane_mp.protocol import (
    DropLora,
    LoadLora,
    LoadWeights,
    LoraLoaded,
    PrepareGrammar,
    RankInfo,
    ResidencyDone,
    ShutdownWorker,
    Sleep,
    StepPlan,
    SwapWeights,
    WakeUp,
    WorkerReady,
)
from crane_mp.worker.bootstrap import LoadedWorker, PhaseTimer, load_worker
from crane_mp.worker.cache.memory import MemoryBudgetError
from crane_mp.worker.parallel.tensor_parallel import TensorParallel, split_cores
from crane_mp.worker.platforms import on_cuda
from crane_mp.worker.platforms.device import RankLost
from crane_mp.worker.residency import Residency, WeightsError
from crane_mp.worker.step.background import BackgroundJobs, load_lora, prepare_grammar
from crane_mp.worker.weights.lora import uninstall

log = logging.getLogger("crane_mp.worker")

# Quiet this long after its last request ends, the worker returns freed heap pages (heap.py).
_IDLE_TRIM_MS = 1000
# And at most this often while busy: steps of ever-changing sizes leave free holes in glibc's arenas
# (a 4-minute soak with prompts up to 1,500 words held 128 MB of them and grew 21 % in its last half).
# Pages given back and used again cost a fault each: a few ms per trim at this interval.
_BUSY_TRIM_SECONDS = 10.0


def describe_ranks(loaded: LoadedWorker, tp: TensorParallel | None) -> list[RankInfo]:
    """Every rank's host, device and weights (gathered from all of them: a collective, so every rank calls it)."""
    device = loaded.platform.device
    cores = sorted(os.sched_getaffinity(0))
    facts = [loaded.kv_plan.weights_bytes, tp.parallel.node_rank if tp is not None else 0,
             device.index if device.type == "cuda" else -1, cores[0], cores[-1]]
    gathered = [facts] if tp is None else tp.gather_facts(facts)
    return [RankInfo(rank, node, f"Cuda({index})" if index >= 0 else f"Cpu(cores {first}-{last})", weights)
            for rank, (weights, node, index, first, last) in enumerate(gathered)]


def worker_ready(loaded: LoadedWorker, ranks: list[RankInfo]) -> WorkerReady:
    plan = loaded.kv_plan
    isa, kernel_isa = loaded.platform.describe()
    return WorkerReady(
        num_blocks=plan.num_blocks,
        block_size=loaded.runner.block_size,
        kv_bytes_per_token=plan.kv_bytes_per_token,
        kv_bytes_per_long_token=plan.kv_bytes_per_long_token,
        kv_windows=list(loaded.runner.kv_groups.windows),
        kv_budget_bytes=plan.kv_budget_bytes,
        activation_bytes=plan.activation_bytes,
        weights_bytes=plan.weights_bytes,
        max_model_len=loaded.max_model_len,
        vocab_size=loaded.model_config.vocab_size,
        eos_token_ids=list(loaded.model_config.eos_token_ids),
        arch=loaded.model_config.arch,
        model_impl="transformers" if loaded.model_config.arch == TRANSFORMERS else "native",
        hf_model_type=getattr(loaded.model_config.hf_config, "model_type", "") or "",
        device=loaded.platform.label(),
        device_type=loaded.platform.name,
        dtype=str(loaded.dtype).removeprefix("torch."),
        isa=isa,
        kernel_isa=kernel_isa,
        model_format=loaded.model_format,
        weight_types=loaded.weight_types,
        weights_file_bytes=loaded.weights_file_bytes,
        hidden_size=loaded.model_config.hidden_size,
        kv_cache_dtype=str(loaded.runner.kv_dtype).removeprefix("torch."),
        quantized_activations=loaded.quantized_activations,
        prefill_seconds_per_token=loaded.prefill_seconds_per_token,
        whole_prompts=loaded.model_config.encoder,
        whole_images=getattr(loaded.runner.model, "bidirectional_images", False),
        state_slots=plan.state_slots,
        state_bytes_per_seq=plan.state_bytes_per_seq,
        tensor_parallel_size=len(ranks),
        nnodes=len({info.node for info in ranks}),
        ranks=ranks,
    )


def _exit_on_signal(signum, frame) -> None:
    _ignore_stop_signals()
    raise SystemExit(0)


def _ignore_stop_signals() -> None:
    """Once exiting, a second stop request (the scheduler's ShutdownWorker, then the launcher's SIGTERM)
    must not raise again inside the interpreter's own clean-up."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def join_ranks(config: EngineConfig, rank: int, run_dir: str) -> TensorParallel | None:
    """With --tensor-parallel-size above 1: this process's device (its host's CUDA device, or its share
    of the host's cores), then the rendezvous with every other rank."""
    parallel = config.parallel
    if parallel.tensor_parallel_size == 1:
        return None
    local_rank = rank - parallel.local_ranks.start
    if parallel.on_loopback():  # gloo listens where the hostname resolves, which may not be loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if on_cuda(config.force_cpu):
        if torch.cuda.device_count() < parallel.ranks_per_node:
            raise ValueError(f"--tensor-parallel-size {parallel.tensor_parallel_size} over {parallel.nnodes} node(s) "
                             f"runs {parallel.ranks_per_node} ranks on this host, one per GPU, and it has "
                             f"{torch.cuda.device_count()} (or serve on CPU with --cpu)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        cores = split_cores(local_rank, parallel.ranks_per_node)
        if cores is not None:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores) if cores is not None else 1)
    log.info("tensor-parallel rank %d of %d (node %d) on %s: meeting the other ranks%s", rank,
             parallel.tensor_parallel_size, parallel.node_rank, device,
             f" at {parallel.dist_init_addr}" if parallel.dist_init_addr else "")
    return TensorParallel(parallel, rank, run_dir, device)


def run_worker(config: EngineConfig, addresses: Addresses, logs: LogSettings, rank: int, ready: Connection) -> None:
    """Worker rank `rank` (0 without tensor parallelism). Rank 0 talks to the scheduler and reports
    WorkerReady; the others follow the frames rank 0 broadcasts and report only that they are ready."""
    configure_logging(logs)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides how Ctrl-C ends the server
    signal.signal(signal.SIGTERM, _exit_on_signal)  # exit through `finally` and interpreter clean-up
    # tqdm's default lock is a multiprocessing semaphore, reported as leaked if this process is killed.
    tqdm.set_lock(threading.RLock())
    timer = PhaseTimer()
    timer.phases.append(("imports", time.time() - psutil.Process().create_time()))  # interpreter, torch, ...
    try:
        tp = join_ranks(config, rank, addresses.run_dir)
        # A progress bar is not a log line: JSON logs get none; only rank 0 draws one.
        loaded = load_worker(config, progress=logs.format == "text" and rank == 0, timer=timer, tp=tp)
    except (MemoryBudgetError, UnsupportedModelError, FileNotFoundError, ValueError, RankLost) as err:
        # A configuration the operator must change: one clear line, no traceback.
        log.error("cannot start the model: %s", err)
        if config.parallel.tensor_parallel_size > 1:  # gloo's threads would abort the interpreter's exit
            logging.shutdown()
            os._exit(1)
        raise SystemExit(1) from None
    loaded.platform.enforce_limit(loaded.kv_plan)
    # Everything allocated so far (torch, transformers, the model) lives as long as this process: keep
    # the cyclic GC from rescanning it in the middle of decode steps. Only here: an engine built inside
    # someone else's process (LLMEngine) must stay collectable.
    gc.collect()
    gc.freeze()
    layout = describe_ranks(loaded, tp)
    log.info("worker start-up%s: %s", f" (rank {rank})" if tp is not None else "", timer.summary())
    if rank == 0:
        ready.send_bytes(encode(worker_ready(loaded, layout)))
    else:
        ready.send_bytes(b"")
    ready.close()
    if tp is None:
        _serve(config, addresses, loaded, None)
        return
    try:
        if rank == 0:
            _serve(config, addresses, loaded, tp)
        else:
            _follow(config, loaded, tp)
        code = 0
    except SystemExit as stop:  # SIGTERM
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        code = 1
    # Not through the interpreter's exit: gloo's threads, blocked in a heartbeat, would abort it.
    logging.shutdown()
    os._exit(code)


def _serve(config: EngineConfig, addresses: Addresses, loaded: LoadedWorker, tp: TensorParallel | None) -> None:
    """Rank 0: execute what the scheduler sends (handing every frame to the other ranks first) and answer."""
    ctx = zmq.Context()
    plans = make_socket(ctx, zmq.PULL, addresses.worker_inbox, bind=False)
    results = make_socket(ctx, zmq.PUSH, addresses.scheduler_inbox, bind=False)
    adapters = BackgroundJobs("lora-loader", ctx, addresses.scheduler_inbox)
    grammars = BackgroundJobs("grammar-builder", ctx, addresses.scheduler_inbox)
    weights = BackgroundJobs("weights-loader", ctx, addresses.scheduler_inbox)
    residency = Residency(config, loaded)
    if loaded.runner.grammars is not None and config.task == "generate":
        grammars.submit(loaded.runner.grammars.load_vocabulary)
    trim = malloc_trim()
    trim_when_quiet = False  # the last request ended: give its memory back if nothing follows soon
    last_trim = time.monotonic()
    try:
        while True:
            if trim_when_quiet and not plans.poll(_IDLE_TRIM_MS):
                trim(0)
                trim_when_quiet = False
                last_trim = time.monotonic()
                continue
            frame = plans.recv()
            message = worker_decoder.decode(frame)
            if tp is not None:
                tp.send_frame(frame)
                if isinstance(message, ShutdownWorker):
                    tp.leave()
            runner = loaded.runner  # a new one after new weights or a deep sleep
            if isinstance(message, StepPlan):
                results.send(encode(runner.execute(message)))
                trim_when_quiet = trim is not None and not runner.requests
                if trim is not None and time.monotonic() - last_trim >= _BUSY_TRIM_SECONDS:
                    trim(0)
                    last_trim = time.monotonic()
            elif isinstance(message, LoadLora):
                on_every_rank = None if tp is None else tp.loaded_on_every_rank
                adapters.submit(partial(_load_lora, residency, message, on_every_rank))
            elif isinstance(message, PrepareGrammar):
                grammars.submit(partial(prepare_grammar, runner.grammars, message))
            elif isinstance(message, DropLora):
                uninstall(runner.model, message.lora_id)
                residency.forget_adapter(message.lora_id)
            elif isinstance(message, (Sleep, WakeUp, SwapWeights)):
                results.send(encode(_change_residency(residency, message)))
            elif isinstance(message, LoadWeights):
                weights.submit(partial(_stage_weights, residency, message.path))
            elif isinstance(message, ShutdownWorker):
                break
    finally:
        _ignore_stop_signals()
        ctx.destroy(linger=0)


def _load_lora(residency: Residency, message: LoadLora, on_every_rank) -> LoraLoaded:
    """Load an adapter, and keep it for new weights (they get every adapter loaded now)."""
    loaded = load_lora(residency.runner.model, message, residency.config.max_lora_rank, residency.loaded.dtype,
                       residency.loaded.platform, on_every_rank)
    if not loaded.error:
        residency.remember_adapter(loaded.adapter)
    return loaded


def _change_residency(residency: Residency, message: Sleep | WakeUp | SwapWeights) -> ResidencyDone:
    """Sleep, wake-up or swap on the step loop's thread (no step runs meanwhile). New weights refused at
    the swap leave the old serving (the answer says why); any other failure leaves the worker without a
    model to run: an engine fault, raised."""
    if isinstance(message, Sleep):
        residency.sleep(message.level)
        return ResidencyDone("sleep", weights_path=residency.weights_path)
    if isinstance(message, WakeUp):
        residency.wake()
        return ResidencyDone("wake", weights_path=residency.weights_path)
    try:
        return ResidencyDone("swap", weights_path=residency.swap())
    except WeightsError as err:
        residency.discard()
        return ResidencyDone("swap", str(err), residency.weights_path)


def _stage_weights(residency: Residency, path: str) -> ResidencyDone:
    """Read new weights beside the step loop; a failure is the request's answer, never the worker's end."""
    try:
        residency.stage(path)
    except Exception as err:  # noqa: BLE001 - bad weights are the caller's to fix; the old ones keep serving
        log.warning("new weights from %s not loaded: %s", path, err)
        residency.discard()
        return ResidencyDone("load", str(err) or type(err).__name__)
    log.info("new weights read from %s; they serve once the requests running now finish", path)
    return ResidencyDone("load", weights_path=path)


def _follow(config: EngineConfig, loaded: LoadedWorker, tp: TensorParallel) -> None:
    """Ranks but 0: execute each frame rank 0 broadcasts, in order, answering no one. Adapters load on a
    thread, as on rank 0, which answers only once every rank's loaded (tp.loaded_on_every_rank);
    grammars are built here before the next frame is read, so they are in place before any step that
    rank 0 (which built its own in the background, then answered) runs with them."""
    runner = loaded.runner
    adapters = BackgroundJobs("lora-loader")
    if runner.grammars is not None and config.task == "generate":  # as rank 0 does; a matcher waits for it
        threading.Thread(target=runner.grammars.load_vocabulary, name="grammar-vocabulary", daemon=True).start()
    trim = malloc_trim()
    last_trim = time.monotonic()
    try:
        while True:
            message = worker_decoder.decode(tp.receive_frame())
            if isinstance(message, StepPlan):
                runner.execute(message)
                if trim is not None and (not runner.requests or time.monotonic() - last_trim >= _BUSY_TRIM_SECONDS):
                    trim(0)
                    last_trim = time.monotonic()
            elif isinstance(message, LoadLora):
                adapters.submit(partial(load_lora, runner.model, message, config.max_lora_rank, loaded.dtype,
                                        loaded.platform, tp.loaded_on_every_rank))
            elif isinstance(message, PrepareGrammar):
                prepare_grammar(runner.grammars, message)
            elif isinstance(message, DropLora):
                uninstall(runner.model, message.lora_id)
            elif isinstance(message, ShutdownWorker):
                tp.leave()
                break
    finally:
        _ignore_stop_signals()
