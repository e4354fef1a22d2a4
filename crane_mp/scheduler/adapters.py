"""The LoRA adapters the server has loaded, as the scheduler keeps them: it hands out adapter ids
(never reused, so a reloaded adapter never meets KV cached under its predecessor), refuses loads past
--max-loras and unloads of adapters that requests still use, and tells every frontend the list."""

from __future__ import annotations

from crane_mp.protocol import LoraAdapter, LoraRegistry


class AdapterError(ValueError):
    """A load or unload that cannot be done; `status` is the HTTP status that fits."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class AdapterTable:
    def __init__(self, modules: tuple[tuple[str, str], ...], max_loras: int) -> None:
        self.loaded = {name: LoraAdapter(i + 1, name, path) for i, (name, path) in enumerate(modules)}
        self.pending: dict[str, LoraAdapter] = {}  # being loaded by the worker, by name
        self.next_id = len(modules) + 1
        self.max_loras = max_loras

    @property
    def ids(self) -> set[int]:
        return {adapter.lora_id for adapter in self.loaded.values()}

    def reserve(self, name: str, path: str) -> LoraAdapter:
        if name in self.loaded or name in self.pending:
            raise AdapterError(f"a LoRA adapter named {name!r} is already loaded")
        if len(self.loaded) + len(self.pending) >= self.max_loras:
            raise AdapterError(f"{self.max_loras} LoRA adapters are loaded (--max-loras); unload one first")
        adapter = LoraAdapter(self.next_id, name, path)
        self.next_id += 1
        self.pending[name] = adapter
        return adapter

    def finish_load(self, adapter: LoraAdapter, ok: bool) -> None:
        self.pending.pop(adapter.name, None)
        if ok:
            self.loaded[adapter.name] = adapter

    def remove(self, name: str, users: int) -> LoraAdapter:
        adapter = self.loaded.get(name)
        if adapter is None:
            raise AdapterError(f"no LoRA adapter named {name!r} is loaded", 404)
        if users:
            raise AdapterError(f"LoRA adapter {name!r} is in use by {users} requests; unload it once they finish")
        return self.loaded.pop(name)

    def registry(self) -> LoraRegistry:
        return LoraRegistry(sorted(self.loaded.values(), key=lambda a: a.lora_id))
