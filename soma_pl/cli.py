"""`python -m soma_pl.cli <command>`: the suite's single entry point.

`fit`, `validate`, `test` and `predict` are LightningCLI's (`soma_pl.lightning_cli`). Every other
command is a plain function whose signature is its schema: typed parameters with defaults, and a
docstring whose first line is the command's description and whose `Args:` section is its `--help`
text. `COMMANDS` maps each command to its function, imported only when the command runs, so
`python -m soma_pl.cli --help` lists every command without importing torch.

Every command takes `--progress` (false hides its progress bar, where it has one; LightningCLI's
commands read it as `--trainer.enable_progress_bar`), so a script may pass it to any of them. Bad
input ends with one line `soma_pl: error: ...` on stderr and exit status 2; Ctrl-C with
`soma_pl: interrupted` and exit status 130.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import re
import signal
import sys
import typing
import warnings
from argparse import ArgumentError
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, set_parsing_settings

from soma_pl.allocator import retain_freed_memory
from soma_pl.config_files import expand_configs, parse_error_line, read_layers
from soma_pl.errors import ConfigError, Interrupted, SomaError
from soma_pl.io import check_output_file

PROG = "python -m soma_pl.cli"


@dataclass(frozen=True)
class Command:
    """One command: its one-line description and the function that runs it."""

    description: str
    """Shown by `--help`; a test checks that it is the first line of the function's docstring."""
    module: str | None = None
    """Where the function lives; None: a LightningCLI subcommand."""
    function: str = "main"
    """The function's name in `module`."""
    flatten: str | None = None
    """A dataclass parameter whose fields are top-level options (`analyze variance --context 4`
    rather than `--settings.context 4`)."""
    positional: str | None = None
    """A list parameter given as the words after the command (`runs A B`) rather than as an option."""
    listing: str | None = None
    """A function of `module` whose text ends `--help` (`reproduce` lists its experiments)."""

    def load(self) -> Callable:
        return getattr(importlib.import_module(self.module), self.function)


COMMANDS: dict[str, Command] = {
    "fit": Command("Train a model from a method config, whose `base:` names its trainer and data layers "
                   "(LightningCLI: `fit --config configs/demo/spsa.yaml`)."),
    "validate": Command("Validation loss of a configured model or a checkpoint (LightningCLI)."),
    "test": Command("Test loss of a configured model or a checkpoint (LightningCLI)."),
    "predict": Command("Each test window's losses from a checkpoint, written to files (LightningCLI)."),
    "prepare": Command("Build a prepared dataset folder (shards, evaluation sets, manifest).",
                       "soma_pl.data.preparation.command", "prepare_dataset"),
    "shard": Command("Split a prepared dataset into N expert shard sets and fit the router.",
                     "soma_pl.data.sharding.command", "shard_dataset"),
    "bench data": Command("Training-stream throughput from shards (windows/s, MB/s).", "soma_pl.bench.data"),
    "bench zo": Command("Zero-order update throughput: batched SPSA vs inference and a naive loop.",
                        "soma_pl.bench.zo", flatten="settings"),
    "bench prepare": Command("`prepare` throughput and peak memory per task at 1 and N tasks, on a generated or a "
                             "real-text corpus.",
                             "soma_pl.bench.prepare"),
    "bench shard": Command("`shard` throughput and peak memory per task at 1 and N tasks, on a generated corpus.",
                           "soma_pl.bench.shard"),
    "bench inference": Command("Table 12: warm inference throughput, latency and peak memory, routing included.",
                               "soma_pl.bench.inference"),
    "bench memory": Command("Peak memory of a ZO (SPSA) update and a BPTT update against context length.",
                            "soma_pl.bench.memory"),
    "bench kernels": Command("Our LSTM stack against torch.nn.LSTM with the same weights: inference, BPTT, grouped.",
                             "soma_pl.bench.kernels"),
    "analyze params": Command("Table 2: parameter counts computed from the real modules.", "soma_pl.analysis.params"),
    "analyze variance": Command("Figs. 10, 11: relative SPSA gradient error at fixed weights, measured and predicted.",
                                "soma_pl.analysis.variance", flatten="settings"),
    "analyze topk": Command("Fig. 16: ensemble-validation loss for every top-k from one pass.",
                            "soma_pl.analysis.topk"),
    "analyze error-correlation": Command("Fig. 17: pairwise error correlation against the gain of averaging.",
                                         "soma_pl.analysis.error_correlation"),
    "evaluate": Command("Frozen next-byte loss (nats/byte) of a checkpoint on a text file or folder.",
                        "soma_pl.evaluate_text"),
    "external-text": Command("Fetch a pinned public text for frozen evaluation (Table 9) and write one .txt per "
                             "document.", "soma_pl.data.corpus.external"),
    "generate": Command("Continue a prompt byte by byte from a checkpoint or an exported folder; prints the "
                        "continuation.", "soma_pl.generate", flatten="sampling"),
    "export": Command("Write a checkpoint as a model folder: model.safetensors, config.json and a model card (no "
                      "Lightning to load).", "soma_pl.export"),
    "sweep": Command("Run (or join) a sweep's Optuna study, one trial at a time.", "soma_pl.sweeps.runner"),
    "sweep calibrate": Command("Time each configuration of a sweep alone, before its trials.",
                               "soma_pl.sweeps.calibration"),
    "sweep report": Command("Table 6 / Table 7 style tables of a sweep's study (nats/byte).", "soma_pl.sweeps.report"),
    "demo": Command("The main job: monolithic SPSA against SOMA at equal compute, a table and a figure.",
                    "soma_pl.reproduce.command", "demo"),
    "reproduce": Command("Run one or more of the paper's experiments and report each beside the paper.",
                         "soma_pl.reproduce.command", positional="experiments", listing="listing"),
    "reproduce docs": Command("Write docs/reproduction.md from every saved experiment result.",
                              "soma_pl.reproduce.tables", "write_docs"),
    "runs": Command("Several runs side by side: their summaries as one table, their validation curves as one figure.",
                    "soma_pl.analysis.runs", positional="runs"),
}


def _listing(prefix: str = "") -> str:
    """The commands under `prefix` (all of them when empty), one per line with its description."""
    names = [name for name in COMMANDS if name.startswith(prefix)]
    width = max(len(name) for name in names)
    return "\n".join(f"  {name:<{width}}  {COMMANDS[name].description}" for name in names)


def _usage(prefix: str = "") -> str:
    command = f"{prefix} " if prefix else ""
    return (f"usage: {PROG} {command}<command> [options]\n\ncommands:\n{_listing(command)}\n\n"
            f"`{PROG} <command> --help` lists a command's options.")


def _split(argv: list[str]) -> tuple[str | None, list[str]]:
    """The longest command at the start of `argv` (`sweep report` before `sweep`), and the rest."""
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and name in COMMANDS:
            return name, argv[words:]
    return None, argv


CLASS_OPTIONS = ("--model", "--data")
"""LightningCLI options that pick a class, whose settings `--<option>.help CLASS` prints."""


def class_help(argv: Sequence[str]) -> list[str]:
    """`fit --model CLASS --help` (also `--model=CLASS`, `--data CLASS`, `-h`) as `fit --model.help
    CLASS`: the class's settings, which is what a Lightning user asks for first, where `--help` alone
    lists the subcommand's options without them. Any other `argv`, and a class given as a file or a
    YAML mapping, comes back as it is."""
    argv = list(argv)
    if not any(arg in ("-h", "--help") for arg in argv):
        return argv
    for index, arg in enumerate(argv):
        option, equals, value = arg.partition("=")
        if option not in CLASS_OPTIONS or (not equals and index + 1 == len(argv)):
            continue
        value, end = (value, index + 1) if equals else (argv[index + 1], index + 2)
        if re.fullmatch(r"[A-Za-z_][\w.]*", value) and not value.endswith((".yaml", ".yml", ".json")):
            asked = [*argv[:index], f"{option}.help", value, *argv[end:]]
            return [arg for arg in asked if arg not in ("-h", "--help")]
    return argv


def progress_as_trainer_option(argv: Sequence[str]) -> list[str]:
    """`--progress V` (or `--progress=V`) as LightningCLI's `--trainer.enable_progress_bar=V`, so that
    `fit` takes the option every other command takes."""
    argv, out = list(argv), []
    while argv:
        arg = argv.pop(0)
        if arg == "--progress" and argv:
            arg = f"--progress={argv.pop(0)}"
        out.append(arg.replace("--progress=", "--trainer.enable_progress_bar=", 1)
                   if arg.startswith("--progress=") else arg)
    return out


def command_parser(name: str) -> ArgumentParser:
    """The parser of a function command: the function's parameters (their docstrings as help) and,
    unless the function has a `config` parameter of its own, `--config FILE.yaml`."""
    command = COMMANDS[name]
    function = command.load()
    epilog = " ".join([*(f"Also `{other}`: {COMMANDS[other].description}" for other in COMMANDS
                         if other.startswith(f"{name} ")),
                       *([getattr(importlib.import_module(command.module), command.listing)()]
                         if command.listing else [])]) or None
    parser = ArgumentParser(prog=f"{PROG} {name}", description=command.description, epilog=epilog,
                            exit_on_error=False)
    parameters = inspect.signature(function).parameters
    if "config" not in parameters:
        parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of these options")
    if "progress" not in parameters:  # one option for every command, so a script may pass it to any
        parser.add_argument("--progress", type=bool, default=True, help="accepted by every command; this one shows "
                                                                         "no progress bar")
    # Field docstrings of the config dataclasses become their options' help; off by default because
    # it is slow for LightningCLI's large class trees.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    try:
        skip = {name for name in (command.flatten, command.positional) if name} or None
        parser.add_function_arguments(function, nested_key=None, skip=skip)
        if command.positional:
            parser.add_argument(command.positional, nargs="+", help=_parameter_help(function, command.positional))
        if command.flatten:
            parser.add_class_arguments(typing.get_type_hints(function)[command.flatten], nested_key=None)
    finally:
        set_parsing_settings(docstring_parse_attribute_docstrings=False)
    # A default that is a sequence of dataclasses (`bench kernels --shapes`) is given as the
    # namespaces it parses to: jsonargparse cannot print the instances (`--print_config`).
    for key, parameter in inspect.signature(function).parameters.items():
        default = parameter.default
        if isinstance(default, tuple | list) and default and all(dataclasses.is_dataclass(d) for d in default):
            parser.set_defaults({key: [Namespace(**dataclasses.asdict(d)) for d in default]})
    return parser


def _parameter_help(function: Callable, name: str) -> str:
    """The `Args:` entry of parameter `name` in `function`'s docstring."""
    import docstring_parser

    entries = docstring_parser.parse(inspect.getdoc(function) or "").params
    return next((" ".join(p.description.split()) for p in entries if p.arg_name == name and p.description), name)


def _arguments(name: str, config: Namespace) -> dict:
    """The function's keyword arguments from a parsed (and instantiated) config."""
    command = COMMANDS[name]
    function = command.load()
    kwargs = {key: config[key] for key in inspect.signature(function).parameters if key != command.flatten}
    if command.flatten:
        flattened = typing.get_type_hints(function)[command.flatten]
        kwargs[command.flatten] = flattened(**{f.name: config[f.name] for f in fields(flattened) if f.init})
    return kwargs


def run_command(name: str, argv: Sequence[str]) -> object:
    """Parse `argv` for the function command `name` and call its function."""
    parser = command_parser(name)
    layered = "config" not in inspect.signature(COMMANDS[name].load()).parameters
    if layered:  # `--config` is the parser's: layers, with the files their `base:` names
        read_layers(argv)  # a `--config` file that is not a YAML mapping: one line naming it
    try:
        config = parser.instantiate(parser.parse_args(expand_configs(argv) if layered else list(argv)))
    except SomaError:
        raise
    except Exception as error:  # jsonargparse's ArgumentError (often several lines), or a bad value
        raise option_error(name, error, argv) from None
    arguments = _arguments(name, config)
    if isinstance(arguments.get("out"), str):  # a result it could not write is refused before the work
        check_output_file(arguments["out"])
    return COMMANDS[name].load()(**arguments)


def option_error(name: str, error: Exception, argv: Sequence[str]) -> ConfigError:
    """A parser's error as one line naming the key (or the `--config` file setting it), then where
    `--help` is."""
    message = " ".join(parse_error_line(str(error), argv).split())
    return ConfigError(f"{name}: {message} (`{PROG} {name} --help` lists the options)")


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    warnings.formatwarning = _one_line_warning
    # A log line that cannot be written (output redirected to a full disk) is dropped, not followed by
    # logging's traceback: the command's own failure to write is its one line.
    logging.raiseExceptions = False
    retain_freed_memory()
    name, rest = _split(argv)
    try:
        if name is not None and COMMANDS[name].module is None:
            from soma_pl.lightning_cli import run_lightning

            try:
                run_lightning(class_help(progress_as_trainer_option(argv)))
            except ArgumentError as error:  # LightningCLI's parser, asked not to print its usage and exit
                raise option_error(name, error, rest) from None
        elif name is not None:
            run_command(name, rest)
        elif not argv or argv[0] in ("-h", "--help"):
            print(_usage(), file=sys.stdout if argv else sys.stderr)
            raise SystemExit(0 if argv else 2)
        elif any(other.startswith(f"{argv[0]} ") for other in COMMANDS):
            asked = argv[1:2] in (["-h"], ["--help"])
            if asked or len(argv) == 1:
                print(_usage(argv[0]), file=sys.stdout if asked else sys.stderr)
                raise SystemExit(0 if asked else 2)
            raise ConfigError(f"unknown command '{argv[0]} {argv[1]}'; `{PROG} {argv[0]} --help` lists them")
        else:
            raise ConfigError(f"unknown command '{argv[0]}'; `{PROG} --help` lists them")
    except SomaError as error:
        print(f"soma_pl: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except (KeyboardInterrupt, Interrupted) as stop:
        # A signal is the user's (or a scheduler's) choice, not a failure to explain: one line, what the
        # command left where it saved something, and the shell's status for the signal (130, 143).
        stopped = stop if isinstance(stop, Interrupted) else Interrupted(signal.SIGINT)
        print("soma_pl: interrupted" + (f": {stopped.detail}" if stopped.detail else ""), file=sys.stderr)
        raise SystemExit(128 + stopped.signal) from None


if __name__ == "__main__":
    main()
