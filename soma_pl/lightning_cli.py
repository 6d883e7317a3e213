"""LightningCLI for `fit`, `validate`, `test` and `predict`.

Defaults a researcher expects: a W&B logger that runs offline (no account, no network; `wandb sync`
later) next to a local CSV logger, a last-and-periodic checkpoint, compute accounting
(`compute.json`), an optional compute budget, and `summary.json` in the run directory. The
`--model` and `--data` classes are picked by `class_path` in the YAML. Checkpoints are written
atomically and read with `weights_only=True` (`soma_pl.callbacks.checkpoint_io`); a full or read-only
disk ends the command with one line.

W&B: every run's config is the whole resolved config, once (`model`, `data`, `trainer`,
`seed_everything`, `checkpoint`, `wandb`, ...; the optimizer under `model.init_args.optimizer`),
whichever W&B logger the run has: the default one or `--trainer.logger WandbLogger`. The `wandb:`
section groups and names the run (sweeps set `--wandb.group=<study> --wandb.name=trial-<n>`); for a
`WandbLogger` named in the config it fills the settings that logger leaves unset;
`--wandb.log_model` logs checkpoints as artifacts. `WANDB_MODE=disabled` leaves the CSV logger
alone. A `fit` resumed from one of its own checkpoints continues its `version_N` folder and W&B run
(`soma_pl.callbacks.run_identity`). `validate` prints each metric once.
`predict` writes each window's losses (`--predictions.*`, `soma_pl.callbacks.predictions`).

Before any work: `--config` files are read as plain YAML and a base layer after the method layer
warns (`soma_pl.config_files`); trainer settings, run folders and the checkpoint folder are checked
(`soma_pl.trainer_checks`: one run per checkpoint folder, `--ckpt_path last` is its newest
checkpoint, a resumed run keeps its settings), and so is `WANDB_MODE` where W&B logs; a bad option
raises jsonargparse's error, which `soma_pl.cli` prints as one line, and a setting a Lightning class
refuses is one line too. Before the first update, an update too large for the memory available is
refused (`soma_pl.callbacks.memory`); a signal ends a `fit` after its current update
(`soma_pl.callbacks.final`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import yaml
from jsonargparse import Namespace, namespace_to_dict
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from soma_pl.callbacks.checkpoint_io import AtomicCheckpointIO
from soma_pl.callbacks.compute import ComputeAccounting, ComputeBudget
from soma_pl.callbacks.divergence import DivergenceCheck
from soma_pl.callbacks.final import EndStateCheckpoint
from soma_pl.callbacks.memory import MemoryCheck
from soma_pl.callbacks.predictions import WindowLossWriter
from soma_pl.callbacks.run_identity import ContinuedCSVLogger, RecordRunIdentity, RunIdentity, wandb_disabled
from soma_pl.callbacks.summary import RunSummary
from soma_pl.config_files import expand_configs, read_layers, warn_on_layer_order
from soma_pl.data.preparation.config import PrepareConfig, recipe_config
from soma_pl.data.training.datamodule import ByteDataModule
from soma_pl.distributed import launching_process
from soma_pl.errors import ConfigError, DataError, Interrupted, SomaError
from soma_pl.lit.base import ByteLMModule
from soma_pl.locks import folder_lock
from soma_pl.trainer import Trainer
from soma_pl.trainer_checks import (
    RUN_SETTINGS_KEY,
    check_folder,
    check_same_settings,
    check_trainer,
    refuse_earlier_run,
    resume_point,
)

RUNS_DIR = "runs"


def trainer_defaults() -> dict:
    """Trainer defaults, and the callbacks every run has (not configurable)."""
    return {"default_root_dir": RUNS_DIR, "callbacks": [RecordRunIdentity(), MemoryCheck()]}


@dataclass
class WandbSettings:
    """Where a run's W&B record goes. W&B runs offline unless the environment sets
    `WANDB_MODE=online`; offline runs are uploaded later with `wandb sync`. `WANDB_MODE=disabled`:
    no W&B logger and nothing of W&B written (the CSV logger still logs)."""

    project: str = "soma_pl"
    group: str | None = None
    """Runs that belong together (a sweep's study name)."""
    name: str | None = None
    """The run's display name (a sweep trial: `trial-<number>`)."""
    job_type: str | None = None
    """None: the subcommand (`fit`, `validate`, `test`, `predict`)."""
    tags: list[str] = field(default_factory=list)
    notes: str | None = None
    entity: str | None = None
    log_model: bool | Literal["all"] = False
    """Checkpoints as W&B artifacts: true, the last and best when `fit` ends; "all", each one as it is saved."""


WANDB_SETTINGS = ("project", "name", "group", "job_type", "tags", "notes", "entity")
"""`WandbSettings` fields that are also `WandbLogger` (or `wandb.init`) arguments of the same name."""


def default_loggers(root: str, settings: WandbSettings | None = None, job_type: str | None = None,
                    resumed: RunIdentity | None = None) -> list:
    """A CSV logger (the run directory is its `root/version_N`) and W&B in `WANDB_MODE` (`make_cli`
    makes it offline unless set; none when disabled), writing under the same root. A resumed run
    (`resumed`) continues its version folder and W&B run. The config is logged by
    `CompleteConfigCallback` when the run starts."""
    settings = settings or WandbSettings()
    resumed = resumed or RunIdentity()
    csv_logger = (CSVLogger(save_dir=root, name="") if resumed.csv_version is None
                  else ContinuedCSVLogger(save_dir=root, version=resumed.csv_version))
    if wandb_disabled():
        return [csv_logger]
    # W&B reads its mode from `WANDB_MODE`; Lightning's `offline=True` would refuse `log_model`.
    return [csv_logger, WandbLogger(
        project=settings.project, name=settings.name, save_dir=root, group=settings.group,
        job_type=settings.job_type or job_type, tags=list(settings.tags) or None, notes=settings.notes,
        entity=settings.entity, id=resumed.wandb_id, log_model=settings.log_model)]


def fill_wandb_logger(logger: Namespace, settings: Namespace | None, root: str, job_type: str | None,
                      resumed: RunIdentity | None = None) -> None:
    """Give a configured `WandbLogger` (`--trainer.logger WandbLogger`) the `wandb:` section's
    settings where its own init args leave them unset, the run's root as its folder, and a resumed
    run's W&B id."""
    init_args = logger.init_args
    values = {key: settings.get(key) for key in WANDB_SETTINGS} if settings is not None else {}
    values["job_type"] = values.get("job_type") or job_type
    values["tags"] = list(values.get("tags") or []) or None
    if init_args.get("version") is None:
        values["id"] = resumed.wandb_id if resumed is not None else None
    if settings is not None and settings.get("log_model") and not init_args.get("log_model"):
        init_args["log_model"] = settings.get("log_model")
    for key, value in values.items():
        if init_args.get(key) is None and value is not None:
            init_args[key] = value
    if init_args.get("save_dir") in (None, ".") and init_args.get("dir") is None:
        init_args["save_dir"] = root


def is_wandb_logger(logger) -> bool:
    class_path = logger.get("class_path", "") if isinstance(logger, Namespace) else ""
    return class_path.rsplit(".", 1)[-1] == WandbLogger.__name__


def without_unset_anonymous(logger: WandbLogger) -> WandbLogger:
    """`WandbLogger` passes `anonymous=None` to `wandb.init`, which W&B answers with a warning that
    the setting has no effect; an unset value is dropped instead."""
    init = getattr(logger, "_wandb_init", {})
    if init.get("anonymous") is None:
        init.pop("anonymous", None)
    return logger


def finish_wandb(exit_code: int = 0) -> None:
    """End the process's W&B run, if any, so the next `fit` in this process (a sweep trial) starts
    its own run instead of appending to this one. `finish` returns before W&B's service has
    written the last records; `teardown` waits for it, so the offline run is complete on disk (ready
    for `wandb sync`) when the command returns."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=exit_code)
        wandb.teardown(exit_code=exit_code)


def uses_wandb(loggers) -> bool:
    """Whether the parsed `trainer.logger` setting gives the run a W&B logger."""
    if loggers in (True, None):  # the default loggers
        return not wandb_disabled()
    return any(is_wandb_logger(logger) for logger in (loggers if isinstance(loggers, list) else [loggers]))


def check_wandb() -> None:
    """W&B's own checks of `WANDB_MODE` and, online, of the account's key, made before any work: W&B
    makes them when its run starts, after the data are prepared, and ends the command with a traceback."""
    import wandb

    mode = os.environ.get("WANDB_MODE")
    try:
        wandb.Settings(mode=mode)
    except ValueError:  # pydantic's ValidationError, listing the modes on several lines
        raise ConfigError(f"WANDB_MODE={mode} is not a W&B mode: use offline (the default: no account, `wandb sync` "
                          "later), online or disabled") from None
    if mode == "online":
        try:
            wandb.login(verify=False)  # the key from WANDB_API_KEY, ~/.netrc or a prompt; no network
        except wandb.errors.Error as error:
            wandb.teardown()  # the process's W&B settings, which login fixed, are not kept for a later run
            raise ConfigError(f"WANDB_MODE=online: {' '.join(str(error).split())} (or set WANDB_API_KEY); "
                              "WANDB_MODE=offline needs no account") from None


def recipe_dataset(config: Namespace) -> None:
    """Put the data settings in use into a parsed config: a data module that names its folder and the
    recipe that builds it (`prepared`, `recipe`) is prepared with the recipe's `dataset:` section,
    not with `dataset`'s defaults (the paper's sizes), so `--print_config`, `config.yaml` and W&B
    show that section. A `dataset` set by hand is left for the data module to refuse."""
    init = config.get("data.init_args") if isinstance(config.get("data"), Namespace) else None
    if init is None or not init.get("prepared") or not init.get("recipe"):
        return
    if isinstance(init.get("dataset"), Namespace) and namespace_to_dict(init.dataset) == asdict(PrepareConfig()):
        _update(init.dataset, asdict(recipe_config(init.recipe, init.prepared)))


def _update(section: Namespace, values: dict) -> None:
    """Set `values` in a parsed dataclass `section`, its nested dataclasses (`corpus`) key by key."""
    for key, value in values.items():
        if isinstance(section[key], Namespace):
            _update(section[key], value)
        else:
            section[key] = value


def plain_config(parser, config: Namespace) -> dict:
    """A subcommand's resolved config as `config.yaml` holds it: plain values, every default filled in."""
    return yaml.safe_load(parser.dump(config, format="yaml", skip_unset=False))


class CompleteConfigCallback(SaveConfigCallback):
    """Saves `config.yaml` into the run folder, or nothing: a write that fails (a full disk) removes
    its partial file and names it in the error. Every logger gets the whole resolved config as the
    run's hyperparameters, once: Lightning's own logging of the module's flat arguments, which
    would repeat part of it beside the nested sections, is turned off. Every checkpoint records it
    (`RUN_SETTINGS_KEY`), so that a resumed run can be held to its settings
    (`soma_pl.trainer_checks.check_same_settings`)."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        config = plain_config(self.parser, self.config)
        for logger in trainer.loggers:
            logger.log_hyperparams(config)
        # Runs before Lightning logs `pl_module.hparams` (setup comes first); the same switch
        # `save_hyperparameters(logger=False)` sets.
        pl_module._log_hyperparams = False
        if trainer.datamodule is not None:
            trainer.datamodule._log_hyperparams = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        try:
            super().setup(trainer, pl_module, stage)
        except OSError as error:
            path = Path(trainer.log_dir or trainer.default_root_dir) / self.config_filename
            with contextlib.suppress(OSError):
                path.unlink()
            raise OSError(error.errno, error.strerror, error.filename or str(path)) from error

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[RUN_SETTINGS_KEY] = plain_config(self.parser, self.config)


class SomaCLI(LightningCLI):
    """LightningCLI with the suite's forced callbacks (checkpointing, compute accounting and budget,
    run summary) and the `wandb:` section."""

    resumed: RunIdentity | None = None
    """The loggers' identity a resumed `fit` continues (`soma_pl.callbacks.run_identity`)."""

    def __init__(self, *args, held: contextlib.ExitStack | None = None, **kwargs):
        """`held`: where a `fit` puts its run folder's lock, which the caller releases when the command
        has ended (`make_cli`); None: no lock is taken."""
        self.held = held
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(EndStateCheckpoint, "checkpoint")
        # Checkpoints are written when a validation ends, after the learning-rate decay it drives:
        # the state a resumed run needs to continue exactly as an uninterrupted one; `last.ckpt`
        # also when training ends, so it holds the last updates.
        # A folder holds one run (`soma_pl.trainer_checks`), so a name written again is the same
        # step's state: it replaces the file instead of adding a numbered copy (`-v1`) beside it.
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 1,
                             "checkpoint.save_on_train_epoch_end": False, "checkpoint.enable_version_counter": False})
        parser.add_lightning_class_args(ComputeAccounting, "compute")
        parser.add_lightning_class_args(ComputeBudget, "budget")
        parser.add_lightning_class_args(RunSummary, "summary")
        parser.add_lightning_class_args(WindowLossWriter, "predictions")
        parser.add_lightning_class_args(DivergenceCheck, "divergence")
        parser.add_class_arguments(WandbSettings, "wandb")
        # Table 1 trains float32 weights with TF32 kernels: `high` lets float32 matrix products run
        # in TF32 on a GPU that has it (cuDNN's LSTM already does, PyTorch's default); no effect on a CPU.
        parser.add_argument("--float32_matmul_precision", choices=["highest", "high", "medium"], default="highest",
                            help="torch.set_float32_matmul_precision: `high` runs float32 matrix products in TF32 "
                                 "on a GPU (configs/trainer/gpu.yaml, Table 1)")

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs):
        """`--weights_only` (of `fit`, `validate`, ...) defaults to true: `--ckpt_path` loads no code."""
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if "weights_only" in self._subcommand_method_arguments[subcommand]:
            parser.set_defaults(weights_only=True)
        return parser

    def parse_arguments(self, parser, args) -> None:
        """Parse `args`, always a list here: `soma_pl.cli.main` hands on the command line after the
        subcommand has picked this CLI, and a caller in Python (a test) its own list.
        LightningCLI's own version warns whenever `args` is given while `sys.argv` holds
        arguments, which is every run from the command line. `--print_config` prints the config
        with the data settings in use (`recipe_dataset`)."""
        printing = next((arg for arg in args if arg.split("=")[0] == "--print_config"), None)
        self.config = parser.parse_args([arg for arg in args if arg is not printing])
        subcommand = self.config.get("subcommand")
        recipe_dataset(self.config[subcommand] if subcommand else self.config)
        if printing is not None:
            flags = printing.partition("=")[2]
            print(self._parser(subcommand).dump(self.config[subcommand] if subcommand else self.config,
                                                skip_none="skip_null" in flags), end="")
            raise SystemExit(0)

    def before_instantiate_classes(self) -> None:
        """Checkpoints go to `<default_root_dir>/checkpoints` unless `checkpoint.dirpath` says otherwise
        (one folder per run, across resumed sessions, where `--ckpt_path` finds `last.ckpt`); trainer
        settings and folders that cannot work are refused; a resumed `fit` continues its loggers'
        run; a `WandbLogger` named in the config takes the `wandb:` section's settings it leaves unset.
        A `fit` holds its run folder (`soma_pl.locks.folder_lock`), and its checkpoint folder where that
        lies outside it: a second `fit` into either at once is refused. A multi-process run is one
        writer: its launching process holds the folders."""
        torch.set_float32_matmul_precision(self._get(self.config, "float32_matmul_precision", default="highest"))
        trainer = self._get(self.config, "trainer")
        root = trainer.get("default_root_dir") or RUNS_DIR
        checkpoint = self._get(self.config, "checkpoint", default=None)
        if checkpoint is not None and checkpoint.get("dirpath") is None:
            checkpoint["dirpath"] = str(Path(root) / "checkpoints")
        check_trainer(trainer)
        check_folder(root, "trainer.default_root_dir")
        if uses_wandb(trainer.get("logger")):
            check_wandb()
        holds = self.subcommand == "fit" and self.held is not None and launching_process()
        if holds:
            self.held.enter_context(folder_lock(Path(root), "--trainer.default_root_dir"))
        if checkpoint is not None:
            check_folder(checkpoint["dirpath"], "checkpoint.dirpath")
            if holds and not Path(checkpoint["dirpath"]).resolve().is_relative_to(Path(root).resolve()):
                self.held.enter_context(folder_lock(Path(checkpoint["dirpath"]), "--checkpoint.dirpath"))
            self._resolve_ckpt_path(Path(checkpoint["dirpath"]), trainer)
            own = self._own_checkpoint(Path(checkpoint["dirpath"]))
            if own is not None:
                self.resumed = RunIdentity.read(own)
                check_same_settings(own, plain_config(self._parser(self.subcommand), self.config[self.subcommand]))
        loggers = trainer.get("logger")
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            if is_wandb_logger(logger):
                fill_wandb_logger(logger, self._get(self.config, "wandb"), root, self.subcommand, self.resumed)

    def _resolve_ckpt_path(self, folder: Path, trainer: Namespace) -> None:
        """`--ckpt_path last` names the run's newest checkpoint; a new `fit` needs a folder without
        another run's checkpoints (`soma_pl.trainer_checks`)."""
        subcommand = self.config.get("subcommand")
        section = self.config[subcommand] if subcommand else None
        if section is None:
            return
        if section.get("ckpt_path") == "last":
            newest = resume_point(folder)
            if newest is not None:
                section["ckpt_path"] = str(newest)
        elif section.get("ckpt_path") is None and subcommand == "fit" and not trainer.get("fast_dev_run"):
            refuse_earlier_run(folder)

    def _own_checkpoint(self, folder: Path) -> Path | None:
        """The checkpoint of its own run (one in the checkpoint `folder`) that a `fit` resumes: the run
        it continues, with the identity and the settings that checkpoint records. None for a new run,
        and for a checkpoint from elsewhere: a run started from another run's checkpoint is a run of
        its own."""
        section = self.config.get("fit") if self.config.get("subcommand") == "fit" else None
        ckpt_path = section.get("ckpt_path") if section is not None else None
        if ckpt_path is None or section.get("weights_only") is False:  # a pickled file: Lightning reads it
            return None
        path = Path(str(ckpt_path)).expanduser()
        if not path.is_file() or path.resolve().parent != folder.expanduser().resolve():
            return None
        return path

    def instantiate_trainer(self, **kwargs):
        """Replace Lightning's default logger (`logger: true`) by the CSV + offline W&B pair, and
        write checkpoints atomically (unless the config names its own CheckpointIO)."""
        config = self._get(self.config_init, "trainer", default={})
        if config.get("logger") in (True, None) and "logger" not in kwargs:
            kwargs["logger"] = default_loggers(config.get("default_root_dir") or RUNS_DIR,
                                               self._get(self.config_init, "wandb"), self.subcommand, self.resumed)
        loggers = kwargs.get("logger", config.get("logger"))
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            if isinstance(logger, WandbLogger):
                without_unset_anonymous(logger)
        if "plugins" not in kwargs:
            plugins = config.get("plugins") or []
            plugins = list(plugins) if isinstance(plugins, list) else [plugins]
            if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
                kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        try:
            return super().instantiate_trainer(**kwargs)
        except MisconfigurationException as error:  # a trainer setting Lightning refuses, named in its message
            raise ConfigError(f"trainer settings: {' '.join(str(error).split())}") from None

    def _run_subcommand(self, subcommand: str) -> None:
        """Run the subcommand. Lightning ends a Ctrl-C it catches with `sys.exit(1)` and a SIGTERM with
        `SIGTERMException` (exit status 0, as if the run had finished); both become `Interrupted`. A
        single-process `fit` stops on either after its current update (`soma_pl.callbacks.final`)."""
        try:
            super()._run_subcommand(subcommand)
        except SIGTERMException:
            raise Interrupted(signal.SIGTERM) from None
        except SystemExit as stop:
            if isinstance(stop.__context__, KeyboardInterrupt):
                raise Interrupted(signal.SIGINT) from None
            raise

    def validate(self, **kwargs) -> list[dict]:
        """`trainer.validate`, with each metric printed once. Lightning prints one column per
        validation loader (here ensemble validation and expert validation) and copies every metric
        logged when validation ends, which all of this suite's are, into each column."""
        verbose = kwargs.pop("verbose", True)
        results = self.trainer.validate(**kwargs, verbose=False)
        if verbose and self.trainer.is_global_zero:
            print(metrics_table("Validate", {key: value for result in results for key, value in result.items()}))
        return results

    def _parse_ckpt_path(self) -> None:
        """Keep the model the config describes when `--ckpt_path` is given.

        LightningCLI would otherwise replace the configured model arguments with the checkpoint's
        hyperparameters, silently overriding what the user asked for; instead the checkpoint is
        checked against the configured shapes and a mismatch is an error naming both. A path that
        names no checkpoint file fails here, before any data is prepared.
        """
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path is not None:
            check_ckpt_path(str(ckpt_path))

    def instantiate_classes(self) -> None:
        """A SomaError from a module's or data module's constructor ends the command with its own
        line (jsonargparse wraps it in an error that lists the whole config), and so does a setting a
        Lightning class refuses (`--checkpoint.save_top_k=3` without a metric to rank by), named in
        Lightning's message."""
        try:
            super().instantiate_classes()
        except Exception as error:
            cause, seen = error, set()
            while cause is not None and not isinstance(cause, SomaError | MisconfigurationException) \
                    and id(cause) not in seen:
                seen.add(id(cause))
                cause = cause.__cause__ or cause.__context__
            if isinstance(cause, MisconfigurationException):
                message = " ".join(str(cause).split())
                raise ConfigError(f"{self._section_named(message) or 'settings'}: {message}") from None
            if not isinstance(cause, SomaError):
                raise
            raise cause from None

    def _section_named(self, message: str) -> str | None:
        """`--<section>.*`, the options of the section whose class (or a base of it) a Lightning message
        names as `Class(...)`, or None."""
        for key, group in self._parser(self.subcommand).groups.items():
            classes = getattr(getattr(group, "group_class", None), "__mro__", (object,))[:-1]  # not `object`
            if any(f"{cls.__name__}(" in message for cls in classes):
                return f"--{key}.*"
        return None


def metrics_table(stage: str, metrics: dict) -> str:
    """`metrics` (name → number or one-element tensor) as a two-column text table, by name."""
    rows = [(name, str(value.item() if hasattr(value, "item") else value)) for name, value in sorted(metrics.items())]
    width = max([len(f"{stage} metric"), *(len(name) for name, _ in rows)])
    rule = "─" * (width + 2 + max([5, *(len(value) for _, value in rows)]))
    lines = [rule, f"{f'{stage} metric':<{width}}  value", rule, *(f"{name:<{width}}  {value}" for name, value in rows)]
    return "\n".join([*lines, rule])


def check_ckpt_path(ckpt_path: str) -> None:
    """Refuse a local `--ckpt_path` that is missing or not a torch checkpoint (a zip archive); names
    Lightning resolves itself (`last`, `best`, ...) and remote URLs pass."""
    if ckpt_path in ("last", "best", "hpc") or ckpt_path.startswith("registry") or "://" in ckpt_path:
        return
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise DataError(f"--ckpt_path {path}: no such checkpoint file")
    if not zipfile.is_zipfile(path):
        raise DataError(f"--ckpt_path {path} is not a checkpoint (torch.save writes a zip archive)")


ROOM = "free space there or set --trainer.default_root_dir (and --checkpoint.dirpath) to a folder on a disk with room"
WRITABLE = "set --trainer.default_root_dir (and --checkpoint.dirpath) to a writable folder"
DISK_ERRORS = {errno.ENOSPC: ROOM, errno.EDQUOT: ROOM, errno.EFBIG: "raise the file size limit (ulimit -f)",
               errno.EROFS: WRITABLE, errno.EACCES: WRITABLE}
"""Errors of the disk a run writes to, which the user fixes, and how."""


def disk_error(error: OSError, argv: Sequence[str]) -> DataError:
    """One line naming the file (or, when the error does not say, the run folder) that could not be
    written, and the setting that moves the run elsewhere."""
    target = error.filename or next((arg.split("=", 1)[1] for arg in argv
                                     if arg.startswith("--trainer.default_root_dir=")), "the run folder")
    return DataError(f"cannot write {target}: {error.strerror or error} (Errno {error.errno}): "
                     f"{DISK_ERRORS[error.errno]}")


def make_cli(argv: Sequence[str], run: bool = True) -> SomaCLI:
    """Parse `argv` (a subcommand first when `run`), instantiate, and run the subcommand."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    warn_on_layer_order(read_layers(argv))
    argv = expand_configs(argv)  # a layer's `base:` files before it
    with contextlib.ExitStack() as held:  # the run folder's lock, until W&B and the process group are closed
        try:
            cli = SomaCLI(
                model_class=ByteLMModule,
                datamodule_class=ByteDataModule,
                trainer_class=Trainer,  # `limit_val_batches: 1` stays one batch
                subclass_mode_model=True,
                subclass_mode_data=True,
                trainer_defaults=trainer_defaults(),
                save_config_callback=CompleteConfigCallback,
                save_config_kwargs={"overwrite": True},
                # The optimizer is a model argument (`--model.init_args.optimizer`), with the module's
                # own learning-rate decay; LightningCLI's `--optimizer` would replace both.
                auto_configure_optimizers=False,
                # A bad option raises (`soma_pl.cli` makes it one line) instead of printing the usage.
                parser_kwargs={"exit_on_error": False},
                args=list(argv),
                run=run,
                held=held,
            )
        except OSError as error:
            finish_wandb(exit_code=1)
            if error.errno in DISK_ERRORS:
                raise disk_error(error, argv) from error
            raise
        except BaseException:
            finish_wandb(exit_code=1)
            raise
        if run:
            finish_wandb()
            close_process_group()
    return cli


def close_process_group() -> None:
    """Destroy the gloo process group a multi-process fit opened. Lightning destroys only NCCL's at
    exit; a gloo group left to the interpreter's teardown can end a finished rank with
    `terminate called without an active exception` and a non-zero status."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    with contextlib.suppress(RuntimeError):  # a rank that died is not waited for
        if dist.get_backend() == "gloo":  # no rank tears down while another still waits on it
            dist.monitored_barrier(timeout=timedelta(seconds=120))
        else:
            dist.barrier()
    dist.destroy_process_group()


def run_lightning(argv: Sequence[str]) -> None:
    if any(arg in ("-h", "--help") or arg.endswith(".help") or arg.startswith("--print_config") for arg in argv):
        # The argument groups' field docstrings (`--model.init_args.spsa.eps`) as help: parsing them is
        # slow for LightningCLI's class trees, so only when help is asked for.
        from jsonargparse import set_parsing_settings

        set_parsing_settings(docstring_parse_attribute_docstrings=True)
    make_cli(argv)
