"""Several models in one server: `--model-path` given more than once (each `NAME=PATH` or a bare path),
or a `[[models]]` table array in the --config file, one table per model with any crane-launch setting
(`model-path`, `model-name`, `task`, `dtype`, `max-seq-len`, `lora-modules`, `gpu-memory-limit` as the
model's memory share, `sleep-idle-seconds`, ...), `pinned = true` and `devices = "1"` (the GPUs its
processes see).

Each model's settings are the shared ones (every other flag, the file's top-level keys, CRANE_*
variables) with its own on top, parsed and checked exactly as a one-model server's (cli.parse_args), so
a bad value in any model's table fails at start with the flag's own message, naming the model.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from crane_mp.cli import build_parser, parse_args
from crane_mp.config import MemoryLimit, ServerConfig

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# Keys of a [[models]] table that are not crane-launch flags.
_ROUTER_KEYS = ("pinned", "devices")
_DEVICES = re.compile(r"^\d+(,\d+)*$")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    config: ServerConfig  # this model's own server, behind the router on a Unix socket
    pinned: bool = False  # loaded at start and never evicted
    share_given: bool = False  # its memory share came from its own settings, not the budget's split
    devices: str | None = None  # the GPUs its processes see (CUDA_VISIBLE_DEVICES), e.g. "1" or "2,3"


@dataclass(frozen=True, slots=True)
class ModelSet:
    models: tuple[ModelSpec, ...]
    public: ServerConfig  # host, port, keys, logs: the router's, from the shared settings
    load_on_demand: bool
    budget: MemoryLimit | None  # --gpu-memory-limit: every loaded model together
    load_timeout: float  # seconds a request may wait for its model to load


def model_set(argv: list[str] | None, environ: Mapping[str, str] | None = None) -> ModelSet | None:
    """The models to serve when the command names more than one (else None: a one-model server)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    paths, common = _split_model_paths(argv)
    tables = _model_tables(common, environ)
    if len(paths) <= 1 and not tables:
        return None
    if paths and tables:
        _fail("give the models either as --model-path flags or as the config file's [[models]] tables, not both")
    entries = [_entry_from_flag(text) for text in paths] if paths else [_entry_from_table(t, i) for i, t in
                                                                        enumerate(tables)]
    # The shared settings alone (every layer: flags, variables, the file's top level): the router's.
    first_path = entries[0][0][entries[0][0].index("--model-path") + 1]
    public = _parse_model(common + ["--model-path", first_path], environ, "shared settings")
    settings = public.settings
    pinned_flag = set(settings.get("pinned-models", {}).get("value") or ())
    specs, names = [], set()
    for index, (argv_extra, name, pinned, share_given, devices) in enumerate(entries):
        config = _parse_model(common + argv_extra, environ, name or f"model {index + 1}")
        name = config.model_name
        if name in names:
            _fail(f"two models are named {name!r}: give each its own model-name (NAME=PATH)")
        names.add(name)
        specs.append(ModelSpec(name, config, pinned or name in pinned_flag, share_given, devices))
    unknown = pinned_flag - names
    if unknown:
        _fail(f"--pinned-models names no served model: {', '.join(sorted(unknown))}")
    budget = public.engine.memory_limit
    specs = [_with_share(spec, budget, len(specs)) for spec in specs]
    return ModelSet(tuple(specs), public, bool(settings.get("load-on-demand", {}).get("value")), budget,
                    float(settings.get("model-load-timeout", {}).get("value") or 300.0))


def _split_model_paths(argv: list[str]) -> tuple[list[str], list[str]]:
    """The --model-path values, and the rest of the command line."""
    paths, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--model-path" and i + 1 < len(argv):
            paths.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--model-path="):
            paths.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return paths, rest


def _config_path(argv: list[str], environ: Mapping[str, str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return environ.get("CRANE_CONFIG") or None


def _model_tables(argv: list[str], environ: Mapping[str, str]) -> list[dict]:
    path = _config_path(argv, environ)
    if not path:
        return []
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return []  # the one-model parse reports it, with its reason
    tables = data.get("models", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        _fail(f"config file {path}: models must be an array of tables ([[models]])")
    if tables and ("model-path" in data or "model_path" in data or data.get("demo")):
        _fail(f"config file {path}: with [[models]] tables, give each model's path in its table, not model-path "
              "at the top level")
    return tables


def _entry_from_flag(text: str) -> tuple[list[str], str | None, bool, bool, None]:
    """NAME=PATH, or a bare PATH (named after its directory or file)."""
    name, sep, path = text.partition("=")
    if not sep or not _NAME.match(name):
        return ["--model-path", text], None, False, False, None
    return ["--model-path", path, "--model-name", name], name, False, False, None


def _entry_from_table(table: dict, index: int) -> tuple[list[str], str | None, bool, bool, str | None]:
    argv: list[str] = []
    actions = {}
    for action in build_parser()._actions:  # by dest and by every spelling of the flag
        for name in (action.dest, *(flag.lstrip("-") for flag in action.option_strings)):
            actions[name.replace("-", "_")] = action
    for key, value in table.items():
        if key in _ROUTER_KEYS:
            continue
        action = actions.get(key.replace("-", "_"))
        if action is None or not action.option_strings or action.dest in ("config", "help"):
            _fail(f"[[models]] table {index + 1}: unknown key {key!r}")
        flag = action.option_strings[0]
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    if "model-path" not in table and "model_path" not in table:
        _fail(f"[[models]] table {index + 1}: model-path is missing")
    name = next((table[key] for key in ("model-name", "model_name", "served-model-name") if key in table), None)
    share = "gpu-memory-limit" in table or "gpu_memory_limit" in table
    devices = table.get("devices")
    if devices is not None and not _DEVICES.match(str(devices)):
        _fail(f"[[models]] table {index + 1}: devices must list GPU indices, as \"1\" or \"0,1\"; got {devices!r}")
    return argv, name, bool(table.get("pinned", False)), share, None if devices is None else str(devices)


def _parse_model(argv: list[str], environ: Mapping[str, str], label: str) -> ServerConfig:
    try:
        return parse_args(argv, environ)
    except SystemExit as stop:
        if isinstance(stop.code, str):  # parse_args's own one-line errors
            _fail(f"{label}: {stop.code.removeprefix('crane-launch: error: ')}")
        if stop.code:  # argparse's, already printed
            print(f"crane-launch: the error above is in the settings of {label}", file=sys.stderr)
        raise


def _with_share(spec: ModelSpec, budget: MemoryLimit | None, count: int) -> ModelSpec:
    """Without a share of its own, a model's memory plan gets an equal part of the budget; its server
    is reached on a Unix socket (the router's job to expose), with no key of its own (the router checks)."""
    config = spec.config
    engine = config.engine
    if not spec.share_given and budget is not None:
        share = (MemoryLimit(num_bytes=budget.num_bytes // count) if budget.num_bytes is not None
                 else MemoryLimit(fraction=budget.fraction / count))
        engine = dataclasses.replace(engine, memory_limit=share)
    config = dataclasses.replace(config, engine=engine, num_frontends=1, api_key=None, admin_api_key=None,
                                 cuda_devices=spec.devices)
    return dataclasses.replace(spec, config=config)


def _fail(message: str) -> None:
    sys.exit(f"crane-launch: error: {message}")
