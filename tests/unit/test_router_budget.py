"""The router's memory budget with stand-in model processes of known sizes: the least recently used
idle model makes room, a model with requests in flight or pinned never does, a load with no room
waits for a model to fall idle (bounded), and what can never fit is refused at once."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import psutil
import pytest

from crane_mp.config import MemoryLimit
from crane_mp.router.command import model_set
from crane_mp.router.manager import LoadQueueFull, ModelManager, ModelUnavailable
from crane_mp.testing.make_model import make_model

GIB = 1 << 30


class FakeGroup:
    """A model's processes holding `size` bytes (its name's entry in SIZES) once started."""

    sizes: dict[str, int] = {}
    started: list[str] = []
    fail: set[str] = set()

    def __init__(self, config, socket_path, target) -> None:
        self.name = config.model_name
        self.alive = False

    async def start(self):
        await asyncio.sleep(0)
        if self.name in self.fail:
            from crane_mp.router.group import GroupFailed

            raise GroupFailed(f"model {self.name}: exited with code 1 while loading")
        self.alive = True
        FakeGroup.started.append(self.name)
        return SimpleNamespace(device_type="cpu", weights_bytes=GIB, kv_budget_bytes=0, activation_bytes=0,
                               max_model_len=64)

    def resident_bytes(self) -> int:
        return self.sizes[self.name] if self.alive else 0

    async def stop(self, grace: float) -> None:
        self.alive = False


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return [make_model("qwen3", "tiny", root / name, seed=1) for name in ("a", "b", "c")]


def _manager(paths, tmp_path, budget_gib: float, pinned=(), max_queue=1024, timeout=300.0) -> ModelManager:
    argv = [arg for path in paths for arg in ("--model-path", str(path))] + ["--load-on-demand"]
    served = model_set(argv + ["--max-queue", str(max_queue)], {})
    own = psutil.Process().memory_info().rss  # the router's own memory counts too
    served = dataclasses.replace(
        served, budget=MemoryLimit(num_bytes=own + int(budget_gib * GIB)), load_timeout=timeout,
        models=tuple(dataclasses.replace(spec, pinned=spec.name in pinned) for spec in served.models))
    FakeGroup.sizes = {"a": 10 * GIB, "b": 10 * GIB, "c": 10 * GIB}
    FakeGroup.started, FakeGroup.fail = [], set()
    return ModelManager(served, str(tmp_path), group_type=FakeGroup)


def _states(manager) -> dict[str, str]:
    return {name: slot.state for name, slot in manager.slots.items()}


async def _use(manager, name: str) -> None:
    await manager.release(await manager.acquire(name))


def test_the_least_recently_used_idle_model_makes_room(paths, tmp_path):
    async def scenario():
        manager = _manager(paths, tmp_path, budget_gib=25)
        await _use(manager, "a")
        await _use(manager, "b")
        await _use(manager, "a")  # b is now the least recently used
        await _use(manager, "c")
        assert _states(manager) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert manager.slots["b"].evictions == 1 and manager.resident_bytes() <= manager.budget
        await manager.stop(0)

    asyncio.run(scenario())


def test_a_model_with_requests_in_flight_or_pinned_is_never_evicted(paths, tmp_path):
    async def scenario():
        manager = _manager(paths, tmp_path, budget_gib=25, pinned=("a",))
        await _use(manager, "a")
        busy = await manager.acquire("b")  # in flight: b may not go, a is pinned
        load = asyncio.create_task(manager.acquire("c"))
        await asyncio.sleep(0.05)
        assert not load.done() and manager.slots["c"].state == "loading" and manager.slots["c"].waiting == 1
        await manager.release(busy)  # b falls idle: it makes room
        await manager.release(await load)
        assert _states(manager) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        await manager.stop(0)

    asyncio.run(scenario())


def test_a_load_with_no_room_within_its_wait_is_unavailable_and_nothing_changes(paths, tmp_path):
    async def scenario():
        manager = _manager(paths, tmp_path, budget_gib=25, timeout=0.2)
        await _use(manager, "a")
        busy = await manager.acquire("b")
        held = await manager.acquire("a")
        with pytest.raises(ModelUnavailable, match="not loaded within"):
            await manager.acquire("c")
        await asyncio.sleep(0.05)  # the load task gives up too
        assert _states(manager) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        await manager.release(busy)
        await manager.release(held)
        await manager.stop(0)

    asyncio.run(scenario())


def test_what_cannot_fit_beside_the_pinned_models_is_refused_at_once(paths, tmp_path):
    async def scenario():
        manager = _manager(paths, tmp_path, budget_gib=15, pinned=("a",))
        await _use(manager, "a")
        with pytest.raises(ModelUnavailable, match="beside the pinned models"):
            await manager.acquire("b")
        assert FakeGroup.started == ["a"]
        await manager.stop(0)

    asyncio.run(scenario())


def test_a_failed_load_is_reported_and_tried_again_by_the_next_request(paths, tmp_path):
    async def scenario():
        manager = _manager(paths, tmp_path, budget_gib=100)
        FakeGroup.fail = {"b"}
        with pytest.raises(ModelUnavailable, match="exited with code 1"):
            await manager.acquire("b")
        FakeGroup.fail = set()
        await _use(manager, "b")
        assert manager.slots["b"].state == "loaded" and manager.slots["b"].loads == 1
        await manager.stop(0)

    asyncio.run(scenario())


def test_requests_waiting_for_a_load_are_bounded_by_the_queue(paths, tmp_path):
    async def scenario():
        manager = _manager(paths, tmp_path, budget_gib=25, max_queue=2)
        await _use(manager, "a")
        busy = [await manager.acquire("a"), await manager.acquire("b")]
        waiting = [asyncio.create_task(manager.acquire("c")) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(LoadQueueFull):
            await manager.acquire("c")
        for slot in busy:
            await manager.release(slot)
        for task in waiting:
            await manager.release(await task)
        await manager.stop(0)

    asyncio.run(scenario())
