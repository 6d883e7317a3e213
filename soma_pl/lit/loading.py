"""The LightningModule of a checkpoint, rebuilt for inference (`evaluate`, `generate`, `export`).

The module class comes from the checkpoint's `_class_path` hyperparameter (written by LightningCLI)
or from `--config`, a fit YAML whose `model:` section names it; only soma_pl's own modules are ever
built. SOMA checkpoints carry their router; `--router` replaces or supplies one.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import yaml
from torch import Tensor

from soma_pl.errors import ConfigError, DataError
from soma_pl.lit.base import ByteLMModule
from soma_pl.models.checkpoints import load_checkpoint
from soma_pl.models.export import ExportedModel, load_exported
from soma_pl.models.router import Router


def _model_section(config: Path) -> tuple[str, dict]:
    """`(class_path, init_args)` of a fit YAML's `model:` section (or of a bare class_path YAML)."""
    if not config.is_file():
        raise DataError(f"config not found: {config}")
    try:
        loaded = yaml.safe_load(config.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"unreadable YAML {config}: {str(error).splitlines()[0]}") from error
    section = loaded.get("model", loaded) if isinstance(loaded, dict) else None
    if not isinstance(section, dict) or "class_path" not in section:
        raise ConfigError(f"{config}: no model.class_path")
    return section["class_path"], dict(section.get("init_args") or {})


def _soma_modules() -> dict[str, type[ByteLMModule]]:
    """soma_pl's LightningModules under each class path that names them (`soma_pl.lit.ZOModule`,
    `soma_pl.lit.zo.ZOModule`)."""
    lit = importlib.import_module("soma_pl.lit")
    classes = {cls.__name__: cls for cls in vars(lit).values()
               if isinstance(cls, type) and issubclass(cls, ByteLMModule) and cls is not ByteLMModule}
    return {path: cls for cls in classes.values()
            for path in (f"{lit.__name__}.{cls.__name__}", f"{cls.__module__}.{cls.__qualname__}")}


def _module_class(class_path: object, source: Path) -> type[ByteLMModule]:
    """The soma_pl module `class_path` (read from `source`) names. A checkpoint may be crafted: the
    path is looked up among soma_pl's own modules, and nothing it names is ever imported."""
    modules = _soma_modules()
    if not isinstance(class_path, str) or class_path not in modules:
        names = ", ".join(sorted({f"soma_pl.lit.{cls.__name__}" for cls in modules.values()}))
        raise ConfigError(f"{source}: model class {class_path!r} is not one of soma_pl's modules ({names})")
    return modules[class_path]


def load_module(checkpoint: str | Path, config: str | Path | None = None,
                router: str | Path | None = None) -> ByteLMModule:
    """The LightningModule of a checkpoint, in eval mode on the CPU.

    Args:
        checkpoint: a Lightning checkpoint of any soma_pl module.
        config: a fit YAML naming the module (`model.class_path`, `model.init_args`); None: the
            checkpoint's own hyperparameters and `_class_path`.
        router: a `router.pt` replacing (or supplying) a SOMA checkpoint's router.
    """
    from lightning.pytorch.cli import instantiate_module

    path = Path(checkpoint).expanduser()
    payload = load_checkpoint(path)
    state, hparams = payload["state_dict"], dict(payload.get("hyper_parameters") or {})
    if config is not None:
        source = Path(config).expanduser()
        class_path, init_args = _model_section(source)
    elif "_class_path" in hparams:
        source, class_path = path, hparams["_class_path"]
        # A subclass's hyperparameters also hold what it passed to its parent's __init__
        # (`ZOModule`'s `head`): keep what this class accepts, as Lightning's own loading does. The
        # optimizer is left out: evaluation steps none, and building it would import the class it names.
        accepted = inspect.signature(_module_class(class_path, source).__init__).parameters
        init_args = {key: value for key, value in hparams.items()
                     if key in accepted and key not in ("self", "optimizer")}
    else:
        raise ConfigError(f"checkpoint {path} does not name its module class: pass --config with the fit YAML")
    try:
        module = instantiate_module(_module_class(class_path, source), init_args)
    except ConfigError:
        raise
    except Exception as error:  # jsonargparse reports a bad key as one of several types
        raise ConfigError(f"cannot build {class_path} from {config or path}: {str(error).splitlines()[0]}") from error
    module.on_load_checkpoint(payload)
    try:
        module.load_state_dict(state)
    except RuntimeError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise ConfigError(f"checkpoint {path} does not fit {class_path}: {lines[-1]}") from error
    _attach_router(module, router)
    return module.eval()


def _attach_router(module: ByteLMModule, router: str | Path | None) -> None:
    """Give an ensemble module the router named on the command line, or its configured `router_path`
    when the checkpoint carries none (the weights are loaded first: a checkpoint's own router
    buffers would otherwise overwrite the replacement)."""
    routing = module.routing
    if not routing.routed:
        if router is not None:
            raise ConfigError(f"--router given, but a {type(module).__name__} of one expert has no router")
        return
    path = router or (routing.router_path if routing.router is None else None)
    if path is not None:
        routing.use(path, f"--router {router}" if router else f"router {path}")


def ensemble_router(module: ByteLMModule) -> Router | None:
    """The router of a routed module; None for any other.

    Raises:
        ConfigError: a routed module whose checkpoint carries no router and was given none.
    """
    routing = module.routing
    if not routing.routed:
        return None
    if routing.router is None:
        raise ConfigError(f"this {type(module).__name__} checkpoint carries no router: pass --router <router.pt>")
    return routing.router


def routed_experts(module: ByteLMModule, windows: Tensor, k: int) -> Tensor:
    """The k experts each window goes to, best first: ``[b, 1025]`` → ``[b, k]``."""
    ensemble_router(module)  # refuses a routed module without one
    return module.ranking(windows)[:, :k]


def ensemble_size(module: ByteLMModule, top_k: int | None) -> int:
    """The experts averaged per window: `top_k`, or the module's own when None; only a routed module
    averages experts (any other uses its first).

    Raises:
        ConfigError: `top_k` outside 1..E for a routed module, or not 1 for any other.
    """
    k = module.eval_k if top_k is None else top_k
    largest = module.model.num_experts if module.routing.routed else 1
    if not 1 <= k <= largest:
        raise ConfigError(f"top_k={k}: this {type(module).__name__} averages 1..{largest} experts")
    return k


def load_source(checkpoint: str, config: str | None = None, router: str | None = None) -> ByteLMModule | ExportedModel:
    """A Lightning checkpoint's module, or an exported folder's model (`soma_pl.models.export`)."""
    path = Path(checkpoint).expanduser()
    if not path.is_dir():
        return load_module(path, config, router)
    if config is not None or router is not None:
        raise ConfigError(f"{checkpoint} is an exported folder: it carries its settings and router; "
                          "leave out --config and --router")
    return load_exported(path)
