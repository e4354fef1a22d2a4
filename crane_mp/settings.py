"""Effective settings from four layers: flag defaults < `--config` TOML file < CRANE_* environment <
command-line flags, and where each value came from.

Every flag is a key: `max-concurrent = 32` in the file (or `max_concurrent`), `CRANE_MAX_CONCURRENT=32`
in the environment; CRANE_CONFIG names the file when --config does not. Values go through the flag's own parser, so a file or variable is checked
exactly as the flag would be. An unknown key in the file is an error naming the key and the file.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Mapping
from pathlib import Path

ENV_PREFIX = "CRANE_"
# CRANE_* variables that are not settings: runtime switches (config.py) and the settings file's path.
_OTHER_ENV = ("CRANE_MP_", "CRANE_CONFIG")
_NOT_SETTINGS = {"help", "config"}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


class SettingsError(ValueError):
    """A bad config file or CRANE_* value; the message is one line naming the key and where it was."""


def settable_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> action for every flag that is a setting."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in _NOT_SETTINGS}


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def _convert(action: argparse.Action, raw: object, where: str) -> object:
    """Parse one file or environment value as the flag would."""
    flag = action.option_strings[0]
    if isinstance(action, argparse._StoreTrueAction):
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return raw.strip().lower() in _TRUE
        raise SettingsError(f"{where}: {flag} is a switch: use true or false, got {raw!r}")
    if action.nargs in ("+", "*"):  # a TOML list, or values separated by spaces
        items = raw if isinstance(raw, list) else str(raw).split()
        return [_convert_one(action, item, where) for item in items]
    if isinstance(raw, (bool, list, dict)):
        raise SettingsError(f"{where}: {flag} takes one value, got {raw!r}")
    return _convert_one(action, raw, where)


def _convert_one(action: argparse.Action, raw: object, where: str) -> object:
    flag = action.option_strings[0]
    if isinstance(raw, (bool, list, dict)):
        raise SettingsError(f"{where}: {flag} takes text values, got {raw!r}")
    text = str(raw)
    try:
        value = action.type(text) if action.type else text
    except (argparse.ArgumentTypeError, ValueError) as err:
        raise SettingsError(f"{where}: {flag}: {err}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise SettingsError(f"{where}: {flag}: invalid choice {value!r} (choose from {choices})")
    return value


def read_config_file(path: str, actions: Mapping[str, argparse.Action]) -> dict[str, object]:
    """The TOML file's settings by dest; an unreadable file or unknown key raises SettingsError."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as err:
        raise SettingsError(f"cannot read config file {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise SettingsError(f"config file {path} is not valid TOML: {err}") from None
    keys = sorted(dest.replace("_", "-") for dest in actions)
    values: dict[str, object] = {}
    for key, raw in data.items():
        if key == "models":
            continue  # several models' own tables (router/command.py)
        dest = key.replace("-", "_")
        if dest not in actions:
            close = difflib.get_close_matches(key.replace("_", "-"), keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            kind = "table" if isinstance(raw, dict) else "key"
            raise SettingsError(f"config file {path}: unknown {kind} {key!r}{hint}")
        values[dest] = _convert(actions[dest], raw, f"config file {path}")
    return values


def unknown_env_names(environ: Mapping[str, str], actions: Mapping[str, argparse.Action]) -> list[str]:
    """CRANE_* variables that name no setting (likely typos)."""
    known = {env_name(dest) for dest in actions}
    return sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known
                  and not name.startswith(_OTHER_ENV))


def resolve(
    parser: argparse.ArgumentParser, argv: list[str] | None, environ: Mapping[str, str]
) -> tuple[argparse.Namespace, dict[str, str]]:
    """Parse argv over the file and environment layers. Returns the namespace and, for every setting,
    its source: "default", "file PATH", "env CRANE_X" or "cli"."""
    actions = settable_actions(parser)
    args = parser.parse_args(argv)
    given = _given_on_cli(parser, argv)
    sources = {dest: "cli" if dest in given else "default" for dest in actions}
    layers: list[tuple[str, dict[str, object]]] = []
    args.config = args.config or environ.get("CRANE_CONFIG") or None
    if args.config:
        layers.append((f"file {args.config}", read_config_file(args.config, actions)))
    env_values = {
        dest: _convert(action, environ[env_name(dest)], f"environment variable {env_name(dest)}")
        for dest, action in actions.items() if env_name(dest) in environ
    }
    layers.append(("env", env_values))
    for origin, values in layers:
        for dest, value in values.items():
            if dest in given:
                continue
            setattr(args, dest, value)
            sources[dest] = f"env {env_name(dest)}" if origin == "env" else origin
    return args, sources


def _given_on_cli(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The dests the command line set explicitly (parsed again with every default suppressed)."""
    quiet = argparse.ArgumentParser(add_help=False)
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        kwargs: dict[str, object] = {"dest": action.dest, "default": argparse.SUPPRESS}
        if isinstance(action, argparse._StoreTrueAction):
            kwargs["action"] = "store_true"
        else:
            kwargs["nargs"] = action.nargs
        quiet.add_argument(*action.option_strings, **kwargs)
    return set(vars(quiet.parse_known_args(argv)[0]))
