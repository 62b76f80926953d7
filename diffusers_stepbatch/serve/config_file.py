"""`--config FILE`: every serve flag as a key of one TOML file (`max-batch-size = 8` or `max_batch_size = 8`,
tables `[call-default]` and `[lora-modules]`); a flag given on the command line wins over the file."""

from __future__ import annotations

import argparse
import difflib
from typing import Any

# File keys that differ from the flag's destination (a table for a repeatable KEY=VALUE flag).
_TABLES = {"call_default": "call_defaults", "call_defaults": "call_defaults", "lora_modules": "lora_modules"}


def read_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's values by the parser's destinations; a ValueError naming an unknown key (with close matches)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    with open(path, "rb") as file:
        raw = tomllib.load(file)
    destinations = {action.dest: action for action in parser._actions if action.dest not in ("help", "config")}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        name = _TABLES.get(name, name)
        if name not in destinations:
            flags = sorted(k.replace("_", "-") for k in destinations)
            close = difflib.get_close_matches(key.replace("_", "-"), flags, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ValueError(f"{path}: unknown key {key!r}{hint}")
        if name == "call_defaults" and isinstance(value, dict):
            value = list(value.items())
        elif name == "lora_modules" and isinstance(value, dict):
            value = [f"{k}={v}" for k, v in value.items()]
        action = destinations[name]
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"{path}: {key} = {value!r} is not one of {list(action.choices)}")
        values[name] = value
    return values


def parse_with_config_file(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv`; with `--config FILE`, the file's values become the defaults the command line overrides."""
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    try:
        parser.set_defaults(**read_config_file(args.config, parser))
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    return parser.parse_args(argv)
