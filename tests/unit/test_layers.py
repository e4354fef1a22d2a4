"""crane_mp's layers, bottom to top (docs/architecture.md states them): a module imports only from its
own layer and the ones below, so a low layer never needs a higher one to be read, and none of the
processes that must stay torch-free reaches the worker through an import. Parsed statically, as
test_import_graph.py parses imports: every import counts, also those inside functions."""

from __future__ import annotations

import pytest

from tests.unit.test_import_graph import import_graph

# Each top-level module or package of crane_mp (its second name part) in one layer.
LAYERS = (
    # settings, protocol, file readers and small pure helpers: they import no other layer
    {"crane_mp", "settings", "protocol", "gguf_header", "heap", "priority", "logs", "systemd", "mrope", "parallel",
     "media_settings"},
    # config, IPC and the torch-free model facts every process reads
    {"config", "ipc", "models", "model_tokenizer"},
    # the scheduler and worker processes
    {"scheduler", "worker"},
    # the HTTP frontend
    {"frontend"},
    # what starts or embeds the processes: the launcher, CLI, process entry points, in-process engine,
    # and the test-model generators (they run the worker)
    {"__main__", "launch", "cli", "speculative_flags", "watchdog", "docs_flags", "entrypoints", "engine", "generate", "testing", "router"},
)
# Only these may import the worker package: they run it (in this process or as one).
RUNS_THE_WORKER = {"worker", "engine", "entrypoints", "testing"}


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "crane_mp"


def _layer(module: str) -> int:
    return next(i for i, areas in enumerate(LAYERS) if _area(module) in areas)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_module_has_a_layer(graph):
    unplaced = sorted({_area(m) for m in graph} - set().union(*LAYERS))
    assert not unplaced, f"place these in LAYERS (and docs/architecture.md): {unplaced}"


def test_no_import_points_up_the_layers(graph):
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if _layer(t) > _layer(m))
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_only_what_runs_the_worker_imports_it(graph):
    reaching = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                      if _area(t) == "worker" and _area(m) not in RUNS_THE_WORKER)
    assert not reaching, "imports of crane_mp.worker:\n" + "\n".join(reaching)


def test_the_checks_see_an_upward_import():
    assert _layer("crane_mp.models.gguf_file") < _layer("crane_mp.worker.step.runner")
    fake = {"crane_mp.models.gguf_file": {"crane_mp.worker.models.registry"}, "crane_mp.worker.models.registry": set()}
    assert [t for m, ts in fake.items() for t in ts if _layer(t) > _layer(m)] == ["crane_mp.worker.models.registry"]
