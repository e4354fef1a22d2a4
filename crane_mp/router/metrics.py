"""/metrics of a server with several models: each loaded model's own exposition (its series labelled
with its model_name) merged family by family with the router's: the state of every model, its loads
and evictions, the requests waiting for it to load, and the memory it holds against the budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from crane_mp.router.manager import ModelManager

_STATES = ("unloaded", "loading", "loaded")


class _RouterCollector:
    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager

    def collect(self):
        manager = self.manager
        state = GaugeMetricFamily("crane:model_state", "1 for the state each model is in.",
                                  labels=["model_name", "state"])
        loads = CounterMetricFamily("crane:model_loads", "Times each model was loaded.", labels=["model_name"])
        evictions = CounterMetricFamily("crane:model_evictions", "Times each model was unloaded to make room.",
                                        labels=["model_name"])
        waiting = GaugeMetricFamily("crane:model_load_waiting", "Requests waiting for their model to load.",
                                    labels=["model_name"])
        resident = GaugeMetricFamily("crane:model_resident_bytes", "Memory each loaded model's processes may "
                                     "hold (its KV cache and activation reserve counted whole).", labels=["model_name"])
        for slot in manager.slots.values():
            for name in _STATES:
                state.add_metric([slot.name, name], 1.0 if slot.state == name else 0.0)
            loads.add_metric([slot.name], slot.loads)
            evictions.add_metric([slot.name], slot.evictions)
            waiting.add_metric([slot.name], slot.waiting)
            resident.add_metric([slot.name], slot.footprint if slot.state == "loaded" else 0)
        families = [state, loads, evictions, waiting, resident]
        if manager.budget is not None:
            families.append(GaugeMetricFamily("crane:memory_budget_bytes", "--gpu-memory-limit, every model "
                                              "together.", value=manager.budget))
        return families


def router_exposition(manager: ModelManager) -> str:
    registry = CollectorRegistry()
    registry.register(_RouterCollector(manager))
    return generate_latest(registry).decode()


def merge_expositions(texts: list[str]) -> str:
    """Prometheus text expositions as one: each family's HELP and TYPE once, then every sample of it."""
    families: dict[str, list[str]] = {}
    for text in texts:
        name = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                lines = families.setdefault(name, [])
                if not any(existing.startswith(line[:7] + name + " ") for existing in lines):
                    lines.insert(sum(1 for existing in lines if existing.startswith("#")), line)
            elif line and not line.startswith("#"):
                families.setdefault(name, []).append(line)
    return "".join(line + "\n" for lines in families.values() for line in lines)
