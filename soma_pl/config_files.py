"""YAML files a user hands to a command: `--config` layers and sweep files.

A file that cannot be read as settings (not UTF-8, not YAML, a `!!python/...` tag, empty, not a
mapping) ends the command with one line naming the file and the place in it. Config layers compose
in order, a later file winning (a trainer base, then a data layer, then a method layer); a base
given after the method layer would silently undo the method's settings, so that order warns,
naming each setting it changes.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from soma_pl.errors import ConfigError

CONFIG_FLAGS = ("--config", "-c")


def read_yaml(path: str | Path, what: str) -> Any:
    """The YAML content of `path` (plain YAML: no Python tags); `what` names the file in errors
    (`--config x.yaml`, `sweep file x.yaml`)."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        line = error.object.count(b"\n", 0, error.start) + 1
        raise ConfigError(f"{what} is not UTF-8 text (byte {error.object[error.start]:#04x} on line {line}): "
                          "save it as UTF-8") from None
    except OSError as error:
        raise ConfigError(f"{what}: cannot read it ({error.strerror or error})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        hint = ("settings are plain YAML values, no `!!python/...` tags" if "constructor for the tag" in problem
                else "fix the file's YAML")
        raise ConfigError(f"{what} is not valid YAML: {problem}{where}: {hint}") from None


def read_settings(path: str | Path, what: str) -> dict:
    """A YAML file that must hold a mapping of settings."""
    content = read_yaml(path, what)
    if content is None:
        raise ConfigError(f"{what} is empty: give a YAML mapping of settings (`trainer:`, `model:`, ...)")
    if not isinstance(content, dict):
        raise ConfigError(f"{what} holds a {type(content).__name__}, not a YAML mapping of settings")
    return content


def config_paths(argv: Sequence[str]) -> list[str]:
    """The files of `--config FILE`, `--config=FILE` and `-c FILE` in `argv`, in order."""
    paths = []
    for index, arg in enumerate(argv):
        if arg in CONFIG_FLAGS and index + 1 < len(argv):
            paths.append(argv[index + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def flatten(settings: dict, prefix: str = "") -> dict[str, Any]:
    """`{"data": {"init_args": {"batch_size": 2}}}` → `{"data.init_args.batch_size": 2}`."""
    flat = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def read_layers(argv: Sequence[str]) -> list[tuple[str, dict]]:
    """Each `--config` file of `argv` that exists, read and checked, as `(path, settings)`; a
    missing file is left to the parser, which names it."""
    return [(path, read_settings(path, f"--config {path}")) for path in config_paths(argv) if Path(path).is_file()]


def _shown(items: list[str], most: int = 3) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def warn_on_layer_order(layers: list[tuple[str, dict]]) -> list[str]:
    """Warn, once per layer, when a layer without `model:` (a trainer base or data layer) comes
    after a method layer and changes settings that layer made; return the warnings."""
    messages, method, made = [], None, {}
    for path, settings in layers:
        flat = flatten(settings)
        if "model" in settings:
            method = path
            made.update(flat)
            continue
        changed = [f"{key}={made[key]!r} → {value!r}" for key, value in flat.items()
                   if key in made and made[key] != value]
        if method is not None and changed:
            messages.append(f"--config {path} comes after the method layer {method} and changes its "
                            f"{_shown(changed)}: a later --config wins, so give the trainer base and the data layer "
                            "before the method layer")
            warnings.warn(messages[-1], stacklevel=1)
        made.update(flat)
    return messages


def setting_source(key: str, layers: list[tuple[str, dict]]) -> str | None:
    """The last `--config` file that sets the dotted `key` (or a key under it), if any."""
    for path, settings in reversed(layers):
        if any(name == key or name.startswith(f"{key}.") for name in flatten(settings)):
            return path
    return None


_UNION_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value type:",
                "Given value:", "Expected a <class 'NoneType'>")
"""Lines of jsonargparse's error for a class argument that repeat what the key and value say."""


def parse_error_line(message: str, argv: Sequence[str] = ()) -> str:
    """jsonargparse's error (often many lines) as one: the innermost key, a class's arguments joined
    as `model.init_args.<key>`, and what is wrong with its value; an option a `--config` file of
    `argv` sets is named with that file."""
    keys, details = [], []
    for line in str(message).splitlines():
        line = line.strip().removeprefix("- ")
        if not line or line.startswith(_UNION_NOISE):
            continue
        key = re.fullmatch(r'Parser key "([^"]+)":\s*(.*)', line)
        if key:
            keys.append(key[1])
            details = [key[2]] if key[2] else []
        else:
            details.append(line)
    text = " ".join(details)
    line = f"{'.init_args.'.join(keys)}: {text}" if keys else text
    # An optional argument group (`spsa: SPSAArgs | None`) is reported as if it were a class: its
    # settings sit directly under it (`model.init_args.spsa.eps`).
    line = re.sub(r"\.(spsa|eggroll)\.init_args\.", r".\1.", line)
    option = re.search(r"option '([^']+)'", line, re.IGNORECASE)
    source = setting_source(option[1], read_layers(argv)) if option else None
    return f"{line}, set in {source}" if source else line
