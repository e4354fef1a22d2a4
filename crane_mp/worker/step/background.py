"""Work the worker does beside its step loop: run-time LoRA loads and grammar matchers. Reading an
adapter takes from milliseconds to minutes, building a large schema's matcher up to a second; on the
loop, every stream would stall behind them. Each kind has one daemon thread, at the lowest CPU priority
(priority.py), taking jobs in order and answering the scheduler on the thread's own socket (a ZeroMQ
socket belongs to one thread).

What a job makes is in place before the scheduler hears of it, so no step can use it half-made: an
adapter is installed (projections look adapters up by id, so installing one beside a running step is
safe) and a request's matcher is prepared, before the answer goes out."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import msgspec
import zmq

from crane_mp.ipc import encode, make_socket
from crane_mp.priority import lower_this_thread
from crane_mp.protocol import GrammarReady, LoadLora, LoraLoaded, PrepareGrammar
from crane_mp.worker.models.layers import CausalLM
from crane_mp.worker.platforms import Platform
from crane_mp.worker.sampling.grammar import GrammarEngine
from crane_mp.worker.weights.lora import load_adapter, uninstall

log = logging.getLogger("crane_mp.worker")


class BackgroundJobs:
    """One daemon thread running jobs in order; each job returns the message sent to the scheduler, or
    None for none. Without a context (a tensor-parallel rank but 0), answers are dropped: rank 0's
    answer speaks for every rank."""

    def __init__(self, name: str, ctx: zmq.Context | None = None, scheduler_inbox: str | None = None) -> None:
        self._ctx, self._address = ctx, scheduler_inbox
        self._jobs: queue.SimpleQueue[Callable[[], msgspec.Struct | None]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, job: Callable[[], msgspec.Struct | None]) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        lower_this_thread()
        results = None if self._ctx is None else make_socket(self._ctx, zmq.PUSH, self._address, bind=False)
        while True:
            answer = self._jobs.get()()
            if answer is not None and results is not None:
                results.send(encode(answer))


def load_lora(model: CausalLM, message: LoadLora, max_rank: int, dtype, platform: Platform,
              on_every_rank: Callable[[bool], bool] | None = None) -> LoraLoaded:
    """Load and install one adapter; a bad one is reported, never raised. `on_every_rank` (tensor
    parallelism): whether every rank loaded its part; where one did not (a path missing on another
    host), no rank keeps the adapter, which would otherwise change only some ranks' partial sums."""
    adapter = message.adapter
    try:
        load_adapter(model, adapter.lora_id, adapter.name, adapter.path, max_rank, dtype, platform)
        error = ""
    except Exception as err:  # noqa: BLE001 - the adapter's fault, reported to the client that asked
        error = str(err) or type(err).__name__
    if on_every_rank is not None and not on_every_rank(not error) and not error:
        uninstall(model, adapter.lora_id)
        error = (f"LoRA adapter {adapter.name!r} could not be loaded on every tensor-parallel rank (the server "
                 "log says why)")
    if error:
        log.warning("LoRA adapter %r from %s not loaded: %s", adapter.name, adapter.path, error)
        return LoraLoaded(message.token, message.frontend_id, adapter, error)
    log.info("LoRA adapter %r loaded from %s (id %d)", adapter.name, adapter.path, adapter.lora_id)
    return LoraLoaded(message.token, message.frontend_id, adapter)


def prepare_grammar(grammars: GrammarEngine, message: PrepareGrammar) -> GrammarReady:
    """Build one grammar's matcher; the frontend validated it, so a failure here is reported, not raised."""
    try:
        grammars.prepare(message.rid, message.grammar)
    except Exception as err:  # noqa: BLE001 - ends the one request, never the worker
        log.warning("request %d: its grammar's matcher could not be built: %s", message.rid, err)
        return GrammarReady(message.rid, f"{type(err).__name__}: the output constraint could not be compiled")
    return GrammarReady(message.rid)
