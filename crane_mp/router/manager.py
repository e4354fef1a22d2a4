"""Which models are loaded, within one memory budget.

Every model has a slot: unloaded, loading or loaded (a loaded model may sleep inside its own processes,
scheduler/residency.py). Loads happen one at a time, so two models are never being sized against the
budget at once. Before a load, the models already loaded are measured (the resident memory of all
their processes on CPU: each worker's runtime counts) and, while the new one's estimate does not fit
beside them, the least recently used loaded model that is idle (no request in flight) and not pinned
is stopped. When nothing can be evicted, the load waits for a model to fall idle, within the request's
wait (--model-load-timeout). A model's estimate is what it measured the last time it was loaded, else
the largest runtime overhead measured so far (or a default before any) plus its memory share, which
an estimate from its config and files of the weights, KV cache and activations its memory plan allows.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
import msgspec
import psutil

from crane_mp.config import MemoryLimit
from crane_mp.protocol import WorkerReady
from crane_mp.router.command import ModelSet, ModelSpec
from crane_mp.router.estimate import model_bytes
from crane_mp.router.group import GroupFailed, ModelGroup

log = logging.getLogger("crane_mp.router")

# A model's processes besides its weights, KV cache and activations (interpreters, torch, the
# tokenizer), until one has been measured.
_DEFAULT_OVERHEAD = 1 << 30
# A CUDA worker's context and allocator slack beside what its memory plan reports.
_CUDA_RUNTIME = 1 << 30


class ModelUnavailable(RuntimeError):
    """The model cannot be served now (a load failed, or no room within the wait); a 503."""


class LoadQueueFull(ModelUnavailable):
    """--max-queue requests already wait for this model to load; a 429."""


@dataclass(slots=True)
class Slot:
    spec: ModelSpec
    socket_path: str
    state: str = "unloaded"  # unloaded | loading | loaded
    group: ModelGroup | None = None
    info: WorkerReady | None = None  # the engine facts of its last load
    session: aiohttp.ClientSession | None = None
    in_flight: int = 0  # requests being forwarded to it now
    waiting: int = 0  # requests waiting for it to load
    last_used: float = 0.0
    footprint: int = 0  # what it may hold, as last measured (bytes)
    loaded_rss: int = 0  # its processes' resident memory once loaded, before any request
    loads: int = 0
    evictions: int = 0
    error: str = ""  # why its last load failed
    model_estimate: int | None = None  # weights, KV cache and activations before it was ever measured
    loaded: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def task(self) -> str:
        return self.spec.config.engine.task


class ModelManager:
    def __init__(self, models: ModelSet, run_dir: str, target: Callable | None = None,
                 group_type: type = ModelGroup) -> None:
        """`target`: each model's process (launch.model_group_main); `group_type`: what runs it."""
        self.models = models
        self.target = target
        self.group_type = group_type
        self.slots = {spec.name: Slot(spec, os.path.join(run_dir, f"model-{index}.sock"))
                      for index, spec in enumerate(models.models)}
        self.budget = _resolve(models.budget)
        self.overhead = 0  # the largest non-model memory a model's processes were measured to hold
        self._load_lock = asyncio.Lock()
        self._idle = asyncio.Condition()  # notified when a request ends: a model may have become evictable
        self._tasks: set[asyncio.Task] = set()  # loads started on demand
        self.runtime_adapters: dict[str, str] = {}  # adapter name -> its model (/v1/load_lora_adapter)
        self.stopping = False

    # ---- start and stop -------------------------------------------------------------------------

    def at_start(self) -> list[Slot]:
        """The models loaded before the server reports ready: the pinned ones, or all without --load-on-demand
        (where the budget cannot hold them all, the later ones evict the earlier idle ones; any model
        unloaded is loaded again when a request names it)."""
        return [slot for slot in self.slots.values() if slot.spec.pinned or not self.models.load_on_demand]

    async def start(self) -> None:
        for slot in self.at_start():
            await self._load(slot, deadline=None)

    async def stop(self, grace: float) -> None:
        self.stopping = True
        await asyncio.gather(*(self._unload(slot, grace, evicted=False) for slot in self.slots.values()
                               if slot.group is not None))

    # ---- requests -------------------------------------------------------------------------------

    async def acquire(self, name: str) -> Slot:
        """The model, loaded (loading it first if it is not, waiting at most --model-load-timeout),
        counted in flight until release()."""
        slot = self.slots[name]
        if slot.state != "loaded":
            if slot.waiting >= self.models.public.max_queue:
                raise LoadQueueFull(f"{slot.waiting} requests already wait for model {name!r} to load (--max-queue); "
                                    "retry later")
            deadline = time.monotonic() + self.models.load_timeout
            slot.waiting += 1
            try:
                while slot.state != "loaded":
                    if self.stopping:
                        raise ModelUnavailable("the server is shutting down")
                    if slot.state == "unloaded":  # never asked for yet, evicted, or its last load failed
                        # Its own task: a client that leaves does not cancel a load others may wait for.
                        slot.state, slot.error = "loading", ""
                        slot.loaded.clear()
                        task = asyncio.create_task(self._load_quietly(slot, deadline))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                    await asyncio.wait_for(slot.loaded.wait(), max(0.0, deadline - time.monotonic()))
                    if slot.state != "loaded" and slot.error:
                        raise ModelUnavailable(f"model {name!r} could not be loaded: {slot.error}")
            except TimeoutError:
                raise ModelUnavailable(f"model {name!r} was not loaded within {self.models.load_timeout:g} s "
                                       "(--model-load-timeout)") from None
            finally:
                slot.waiting -= 1
        slot.in_flight += 1
        slot.last_used = time.monotonic()
        return slot

    async def _load_quietly(self, slot: Slot, deadline: float) -> None:
        try:
            await self._load(slot, deadline)
        except (GroupFailed, ModelUnavailable, TimeoutError) as err:
            log.error("model %s not loaded: %s", slot.name, slot.error or err)

    async def release(self, slot: Slot) -> None:
        slot.in_flight -= 1
        slot.last_used = time.monotonic()
        async with self._idle:
            self._idle.notify_all()

    # ---- names -----------------------------------------------------------------------------------

    def model_for(self, name: str) -> str | None:
        """The served model a request's `model` names: a model's name or path, or one of its adapters."""
        if name in self.slots:
            return name
        for slot in self.slots.values():
            if name == slot.spec.config.engine.model_path or name in self.adapters_of(slot):
                return slot.name
        return None

    def adapters_of(self, slot: Slot) -> list[str]:
        static = [name for name, _ in slot.spec.config.engine.lora_modules]
        return static + [name for name, base in self.runtime_adapters.items() if base == slot.name]

    def adapters_changed(self, slot: Slot, path: str, body: bytes) -> None:
        """A run-time adapter was loaded on or unloaded from `slot` (its own answer said so)."""
        try:
            name = msgspec.json.decode(body).get("lora_name")
        except (msgspec.DecodeError, AttributeError):
            return
        if path.endswith("/load_lora_adapter"):
            self.runtime_adapters[name] = slot.name
        else:
            self.runtime_adapters.pop(name, None)

    # ---- loading and evicting -------------------------------------------------------------------

    async def _load(self, slot: Slot, deadline: float | None) -> None:
        slot.state, slot.error = "loading", ""
        slot.loaded.clear()
        async with self._load_lock:
            try:
                await self._make_room(slot, deadline)
                group = self.group_type(slot.spec.config, slot.socket_path, self.target)
                slot.group = group
                slot.info = await group.start()
            except (GroupFailed, ModelUnavailable, TimeoutError) as err:
                if slot.group is not None:
                    await slot.group.stop(0)
                slot.group, slot.state = None, "unloaded"
                slot.error = str(err) if isinstance(err, (GroupFailed, ModelUnavailable)) else "no room within the wait"
                slot.loaded.set()
                raise
            # No Content-Type of aiohttp's own: a bodiless POST would carry octet-stream, which the
            # frontends refuse (only JSON bodies are taken).
            slot.session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=slot.socket_path, limit=0), auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30), skip_auto_headers=("Content-Type",))
            slot.state, slot.loads = "loaded", slot.loads + 1
            slot.last_used = time.monotonic()
            self._measure(slot)
            slot.loaded.set()
            log.info("model %s loaded: %s resident%s", slot.name, _gib(slot.footprint),
                     f", budget {_gib(self.budget)} ({_gib(self.resident_bytes())} in use)" if self.budget else "")
            await self._fit_after_load(slot)

    def _measure(self, slot: Slot) -> None:
        info = slot.info
        if slot.group is None or info is None:
            return
        if info.device_type == "cuda":
            slot.footprint = info.weights_bytes + info.kv_budget_bytes + info.activation_bytes + _CUDA_RUNTIME
            return
        # On CPU the KV cache becomes resident as requests write it, and activations only while a step
        # runs: both are counted whole on top of what the model held once loaded.
        resident = slot.group.resident_bytes()
        slot.loaded_rss = slot.loaded_rss or resident
        slot.footprint = max(resident, slot.loaded_rss + info.kv_budget_bytes) + info.activation_bytes
        self.overhead = max(self.overhead, slot.loaded_rss - info.weights_bytes)

    def estimate(self, slot: Slot) -> int:
        """What loading `slot` will hold: its last measure, else the overhead measured so far plus what its
        config and files say its weights, KV cache and activations take."""
        if slot.footprint:
            return slot.footprint
        if slot.model_estimate is None:
            engine = slot.spec.config.engine
            try:
                slot.model_estimate = model_bytes(engine, psutil.virtual_memory().total)
            except Exception as err:  # noqa: BLE001 - its load will say what is wrong; size it by its share
                log.warning("model %s: no estimate of its memory (%s)", slot.name, err)
                slot.model_estimate = _resolve(engine.memory_limit) or 0
        return (self.overhead or _DEFAULT_OVERHEAD) + slot.model_estimate

    def resident_bytes(self) -> int:
        """The server's memory now: this process's and every loaded model's."""
        for slot in self.slots.values():
            if slot.state == "loaded":
                self._measure(slot)
        own = psutil.Process().memory_info().rss
        return own + sum(slot.footprint for slot in self.slots.values() if slot.state == "loaded")

    async def _make_room(self, slot: Slot, deadline: float | None) -> None:
        if self.budget is None:
            return
        need = self.estimate(slot)
        while self.resident_bytes() + need > self.budget:
            victim = self._victim(exclude=slot)
            if victim is not None:
                await self._unload(victim, grace=0, evicted=True)
                continue
            loaded = [s for s in self.slots.values() if s.state == "loaded" and s is not slot]
            if not loaded or all(s.spec.pinned for s in loaded):
                raise ModelUnavailable(
                    f"model {slot.name!r} needs about {_gib(need)} and {_gib(self.budget - self.resident_bytes())} "
                    f"of the {_gib(self.budget)} budget (--gpu-memory-limit) is free beside the pinned models")
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            async with self._idle:
                await asyncio.wait_for(self._idle.wait(), timeout)

    async def _fit_after_load(self, slot: Slot) -> None:
        """The model measured more than estimated: evict idle others until the budget holds again."""
        while self.budget is not None and self.resident_bytes() > self.budget:
            victim = self._victim(exclude=slot)
            if victim is None:
                log.warning("%s resident is over the %s budget (--gpu-memory-limit) and no model is idle to evict",
                            _gib(self.resident_bytes()), _gib(self.budget))
                return
            await self._unload(victim, grace=0, evicted=True)

    async def room_for_new_weights(self, slot: Slot) -> None:
        """New weights are read beside the served ones: room for a second copy, evicting idle models
        if it must; ModelUnavailable when even that leaves too little."""
        if self.budget is None or slot.info is None:
            return
        async with self._load_lock:
            need = slot.info.weights_bytes
            while self.resident_bytes() + need > self.budget:
                victim = self._victim(exclude=slot)
                if victim is None:
                    raise ModelUnavailable(
                        f"no room for a second copy of {slot.name!r}'s weights ({_gib(need)}) within the "
                        f"{_gib(self.budget)} budget (--gpu-memory-limit) while they are read")
                await self._unload(victim, grace=0, evicted=True)

    def _victim(self, exclude: Slot) -> Slot | None:
        idle = [s for s in self.slots.values()
                if s.state == "loaded" and s is not exclude and not s.spec.pinned and s.in_flight == 0]
        return min(idle, key=lambda s: s.last_used, default=None)

    async def _unload(self, slot: Slot, grace: float, evicted: bool) -> None:
        if evicted:
            log.info("model %s evicted (least recently used, idle) to make room", slot.name)
            slot.evictions += 1
        slot.state = "unloaded"
        slot.loaded.clear()
        self.runtime_adapters = {name: base for name, base in self.runtime_adapters.items() if base != slot.name}
        if slot.session is not None:
            await slot.session.close()
            slot.session = None
        if slot.group is not None:
            await slot.group.stop(grace)
            slot.group = None
        slot.loaded_rss = 0

    async def lost(self, slot: Slot) -> None:
        """A loaded model's processes died by themselves: it is unloaded (loaded again on demand)."""
        slot.error = f"its processes exited with code {slot.group.process.exitcode if slot.group else '?'}"
        log.error("model %s: %s", slot.name, slot.error)
        await self._unload(slot, 0, evicted=False)


def _resolve(limit: MemoryLimit | None) -> int | None:
    if limit is None:
        return None
    return limit.resolve(psutil.virtual_memory().total)


def _gib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / (1 << 30):.2f} GiB"
