"""Run-time LoRA loads on a thread beside the step loop: reading and checking an adapter's files takes
from milliseconds to minutes (a large file on a slow disk), and every stream would stall behind it on
the loop. The adapter is installed before the scheduler hears it is loaded, so no step can use it
half-made; projections look their adapters up by id, so installing one beside a running step is safe."""

from __future__ import annotations

import logging
import queue
import threading

import zmq

from crane_mp.ipc import encode, make_socket
from crane_mp.protocol import LoadLora, LoraLoaded
from crane_mp.worker.lora import load_adapter
from crane_mp.worker.models.layers import CausalLM
from crane_mp.worker.platforms import Platform

log = logging.getLogger("crane_mp.worker")


def load_one(model: CausalLM, message: LoadLora, max_rank: int, dtype, platform: Platform) -> LoraLoaded:
    """Load and install one adapter; a bad one is reported, never raised."""
    adapter = message.adapter
    try:
        load_adapter(model, adapter.lora_id, adapter.name, adapter.path, max_rank, dtype, platform)
    except Exception as err:  # noqa: BLE001 - the adapter's fault, reported to the client that asked
        log.warning("LoRA adapter %r from %s not loaded: %s", adapter.name, adapter.path, err)
        return LoraLoaded(message.token, message.frontend_id, adapter, str(err) or type(err).__name__)
    log.info("LoRA adapter %r loaded from %s (id %d)", adapter.name, adapter.path, adapter.lora_id)
    return LoraLoaded(message.token, message.frontend_id, adapter)


class AdapterLoader:
    """One daemon thread taking LoadLora messages in order, answering the scheduler on its own socket
    (a ZeroMQ socket belongs to one thread)."""

    def __init__(self, model: CausalLM, max_rank: int, dtype, platform: Platform, ctx: zmq.Context,
                 scheduler_inbox: str) -> None:
        self._load = lambda message: load_one(model, message, max_rank, dtype, platform)
        self._ctx, self._address = ctx, scheduler_inbox
        self._jobs: queue.SimpleQueue[LoadLora] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="lora-loader", daemon=True).start()

    def submit(self, message: LoadLora) -> None:
        self._jobs.put(message)

    def _run(self) -> None:
        results = make_socket(self._ctx, zmq.PUSH, self._address, bind=False)
        while True:
            results.send(encode(self._load(self._jobs.get())))
