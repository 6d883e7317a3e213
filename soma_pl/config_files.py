"""YAML files a user hands to a command: `--config` layers and sweep files.

A file that cannot be read as settings (not UTF-8, not YAML, a `!!python/...` tag, empty, not a
mapping) ends the command with one line naming the file and the place in it. Config layers compose
in order, a later file winning (a trainer base, then a data layer, then a method layer); a base
given after the method layer would silently undo the method's settings, so that order warns,
naming each setting it changes.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
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


def config_args(paths: Sequence[str]) -> list[str]:
    """`paths` as repeated `--config` arguments."""
    return [arg for path in paths for arg in ("--config", str(path))]


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


BASE = "base"
"""A layer's key naming the layers it builds on (`base: [../trainer/cpu.yaml, ../datamodule/demo.yaml]`,
relative to the layer's own file), read before it: one file names a whole run."""

SUBCLASS_SECTIONS = ("model", "data")
"""Top-level sections whose every key other than `class_path` is an argument of the class."""

_CLASS_KEYS = ("class_path", "init_args", "dict_kwargs")


def nested_form(value: Any, what: str, subclass: bool = False) -> Any:
    """A layer's settings in the parser's form: a class's arguments written beside its `class_path`
    (`optimizer: {class_path: torch.optim.SGD, lr: 0.05}`, and any key of `model:` or `data:`) are
    moved under `init_args`; settings already there are left as they are."""
    if isinstance(value, list):
        return [nested_form(item, what) for item in value]
    if not isinstance(value, dict):
        return value
    value = {key: nested_form(item, what, subclass=False) for key, item in value.items()}
    if not (subclass or "class_path" in value):
        return value
    shallow = {key: item for key, item in value.items() if key not in _CLASS_KEYS}
    if not shallow:
        return value
    init_args = value.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise ConfigError(f"{what}: init_args must be a mapping of settings, got {init_args!r}")
    both = sorted(set(shallow) & set(init_args))
    if both:
        raise ConfigError(f"{what}: {both[0]} is set both beside class_path and under its init_args: keep one")
    return {**{key: item for key, item in value.items() if key in _CLASS_KEYS}, "init_args": {**init_args, **shallow}}


@dataclass(frozen=True)
class Layer:
    path: str
    bases: list[str]
    """The files its `base:` names, resolved against its folder."""
    settings: dict
    """Its own settings in the parser's form, without `base:`."""
    as_written: bool
    """Whether the file itself can go to the parser (no `base:`, no shallow class arguments)."""


def read_layer(path: str | Path) -> Layer:
    """A `--config` layer, read and checked."""
    what = f"--config {path}"
    raw = read_settings(path, what)
    base = raw.get(BASE)
    if base is None:
        bases = []
    elif isinstance(base, str):
        bases = [base]
    elif isinstance(base, list) and base and all(isinstance(item, str) for item in base):
        bases = list(base)
    else:
        raise ConfigError(f"{what}: base must be a file or a list of files, got {base!r}")
    folder = Path(path).parent
    bases = [item if Path(item).is_absolute() else os.path.normpath(folder / item) for item in bases]
    for item in bases:
        if not Path(item).is_file():
            raise ConfigError(f"{what}: its base {item} does not exist (a base is relative to the layer's folder)")
    settings = {key: nested_form(item, what, subclass=key in SUBCLASS_SECTIONS)
                for key, item in raw.items() if key != BASE}
    return Layer(str(path), bases, settings, settings == raw)


def _layers(paths: Sequence[str]) -> list[Layer]:
    """The layers of `paths`, each file's bases before it (depth first), a file read once, at its
    first place."""
    done: dict[str, Layer] = {}

    def visit(path: str, chain: tuple[str, ...]) -> None:
        key = os.path.realpath(path)
        if key in chain:
            cycle = " → ".join(os.path.relpath(name) for name in (*chain[chain.index(key):], key))
            raise ConfigError(f"--config {path}: its bases lead back to it ({cycle})")
        if key in done:
            return
        layer = read_layer(path)
        for base in layer.bases:
            visit(base, (*chain, key))
        done[key] = layer

    for path in paths:
        if Path(path).is_file():
            visit(path, ())
    return list(done.values())


def _placed(path: str, seen: set[str]) -> list[Layer]:
    """The layers `--config path` puts before the parser: its bases not given before (`seen`, the
    real paths placed so far, which it extends), then the file itself, which keeps its place even
    when it was read before (a base given again after its method layer still wins, and warns)."""
    placed = []
    for layer in _layers([path]):
        key = os.path.realpath(layer.path)
        if key in seen and key != os.path.realpath(path):
            continue
        seen.add(key)
        placed.append(layer)
    return placed


def read_layers(argv: Sequence[str]) -> list[tuple[str, dict]]:
    """Each `--config` file of `argv` that exists, with the bases it names before it, read and
    checked, as `(path, settings)` in the order the parser reads them; a missing file is left to
    the parser, which names it."""
    seen: set[str] = set()
    return [(layer.path, layer.settings) for path in config_paths(argv) if Path(path).is_file()
            for layer in _placed(path, seen)]


def expand_configs(argv: Sequence[str]) -> list[str]:
    """`argv` with every `--config FILE` preceded by the layers its `base:` names (a file given
    once), and a layer the parser cannot read as written (a `base:` key, a class's arguments beside
    its `class_path`) handed to it as its settings in the parser's form."""
    out, seen = [], set()
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg in CONFIG_FLAGS and index + 1 < len(argv):
            path, index = argv[index + 1], index + 2
        elif arg.startswith("--config="):
            path, index = arg.split("=", 1)[1], index + 1
        else:
            out.append(arg)
            index += 1
            continue
        if not Path(path).is_file():
            out += ["--config", path]  # the parser names a missing file, or reads YAML text
            continue
        for layer in _placed(path, seen):
            out += ["--config", layer.path if layer.as_written else yaml.safe_dump(layer.settings, sort_keys=False)]
    return out


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
    source = None
    if option:
        layers = read_layers(argv)
        within = f"{'.init_args.'.join(keys)}.init_args.{option[1]}" if keys else None  # a class's argument
        source = (within and setting_source(within, layers)) or setting_source(option[1], layers)
    return f"{line}, set in {source}" if source else line


def cli_value(value: Any) -> str:
    """A value as `--key=value` text that jsonargparse reads back as the same value."""
    if isinstance(value, float):
        text = repr(value)
        # YAML 1.1 reads '1e-05' as a string: give the mantissa a dot.
        mantissa, _, exponent = text.partition("e")
        return f"{mantissa}.0e{exponent}" if exponent and "." not in mantissa else text
    if isinstance(value, str):
        return value
    return json.dumps(value)


def override_args(overrides: dict[str, Any]) -> list[str]:
    """`{dotted key: value}` as `--key=value` arguments of a command."""
    return [f"--{key}={cli_value(value)}" for key, value in overrides.items()]
