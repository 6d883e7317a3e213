"""An exported model: `model.safetensors` and `config.json`, read back with plain torch (no Lightning).

The `export` command (`soma_pl.export`) writes a folder holding a model card (`README.md`) and

- `model.safetensors`: the stacked experts' weights under `model.<name>` (`[E, ...]`: every expert;
  a shared head is `[256, d_E]`) and, for a routed ensemble, its router's under `router.<name>`
  (`router.centroids` `[N, D]`, the encoder's state under `router.encoder.`);
- `config.json`: the format, soma_pl's version, the model's shape (`model`), the vocabulary (256),
  the router's encoder and sharding, the ensemble size (`top_k`) and first scored target
  (`score_from`), every tensor's shape, and what the writer adds (method, module settings, the data
  fingerprints and settings, the scores known).

:func:`load_exported` (`ExportedModel.from_pretrained`) rebuilds an :class:`ExportedModel` from it; this
module imports neither Lightning nor any part of soma_pl that does, so a deployment needs only torch
and safetensors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import Tensor, nn

from soma_pl import ROUTE_BYTES, VOCAB_SIZE, __version__
from soma_pl.errors import DataError
from soma_pl.io import write_atomic, write_json_atomic
from soma_pl.models.router import Router, encoder_from_saved
from soma_pl.models.stacked import HeadMode, StackedExperts

EXPORT_FORMAT = 2
"""2: the LSTM gate rows in ``torch.nn.LSTM``'s order (input, forget, cell, output); 1 had (input,
forget, output, cell) and is refused."""
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
CARD_FILE = "README.md"
_MODEL, _ROUTER, _ENCODER = "model.", "router.", "router.encoder."


class ExportedModel(nn.Module):
    """The experts of an export, the router of an ensemble, and the evaluation settings they came with.

    It routes as the Lightning module did (`ranking`, `routed`, `eval_k`), so inference code takes
    either one.

    Args:
        model: the stacked experts (E = 1: monolithic).
        router: nearest-centroid routing on a window's first 256 bytes; None: not a routed ensemble.
        top_k: experts averaged per window (1 without a router).
        score_from: first target scored in evaluation (the paper: 256).
    """

    def __init__(self, model: StackedExperts, router: Router | None, top_k: int, score_from: int):
        super().__init__()
        self.model, self.router, self.top_k, self.score_from = model, router, top_k, score_from

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ExportedModel:
        """The model of an exported folder, in eval mode on the CPU (:func:`load_exported`)."""
        return load_exported(folder)

    @property
    def routed(self) -> bool:
        return self.router is not None

    @property
    def eval_k(self) -> int:
        return self.top_k

    @property
    def routing(self) -> ExportedModel:
        """Where a module keeps its router and top-k (`module.routing`): an exported model holds them itself."""
        return self

    def ranking(self, windows: Tensor) -> Tensor:
        """Expert order per window, best first: `[b, >=256]` → `[b, E]` (no router: index order)."""
        if self.router is None:
            return torch.arange(self.model.num_experts, device=windows.device).expand(windows.shape[0], -1)
        return self.router.ranking(windows[:, :ROUTE_BYTES])

    def forward(self, tokens: Tensor) -> Tensor:
        """Each expert's logits on its own bytes: tokens `[E, b, T]` → `[E, b, T, 256]`."""
        return self.model(tokens)


def export_tensors(model: StackedExperts, router: Router | None) -> dict[str, Tensor]:
    """The tensors `model.safetensors` holds, by name (contiguous, on the CPU)."""
    tensors = {_MODEL + name: value for name, value in model.state_dict().items()}
    if router is not None:
        tensors.update({_ROUTER + name: value for name, value in router.state_dict().items()})
    return {name: value.detach().cpu().contiguous() for name, value in tensors.items()}


def save_exported(folder: Path, model: StackedExperts, router: Router | None, top_k: int, score_from: int,
                  extra: Mapping[str, object]) -> dict:
    """Write `model.safetensors` and `config.json` into `folder` (each file atomically); returns the config.

    Args:
        extra: more `config.json` fields (method, settings, data fingerprints, the source).
    """
    tensors = export_tensors(model, router)
    described = None if router is None else {
        "encoder": router.encoder.kind.value, "encoder_config": router.encoder.config(),
        "experts": router.num_experts, "sharding": router.sharding}
    config = {
        "format": EXPORT_FORMAT, "soma_pl_version": __version__, **extra, "vocab_size": VOCAB_SIZE,
        "model": {"num_experts": model.num_experts, "width": model.width, "embed_dim": model.embed_dim,
                  "num_layers": model.num_layers, "head": model.head_mode.value, "time_chunk": model.time_chunk},
        "router": described, "top_k": top_k, "score_from": score_from, "route_bytes": ROUTE_BYTES,
        "tensors": {name: list(value.shape) for name, value in tensors.items()},
    }
    write_atomic(save(tensors, metadata={"format": str(EXPORT_FORMAT)}), Path(folder) / WEIGHTS_FILE)
    write_json_atomic(Path(folder) / CONFIG_FILE, config)
    return config


def read_export_config(folder: str | Path) -> dict:
    """`config.json` of an exported folder.

    Raises:
        DataError: the folder or file is missing, not JSON, or of another format.
    """
    path = Path(folder).expanduser() / CONFIG_FILE
    if not path.is_file():
        raise DataError(f"exported model not found: {path} is missing (`python -m soma_pl.cli export` writes it)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise DataError(f"unreadable {path}: {error}") from error
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        found = config.get("format") if isinstance(config, dict) else None
        raise DataError(f"{path}: format {found!r}, expected {EXPORT_FORMAT}: export the checkpoint again")
    return config


def load_exported(folder: str | Path) -> ExportedModel:
    """An exported folder as an :class:`ExportedModel` in eval mode on the CPU (torch and safetensors only).

    Raises:
        DataError: a file is missing or corrupt, or the weights do not fit `config.json`.
    """
    folder = Path(folder).expanduser()
    config = read_export_config(folder)
    try:
        tensors = load_file(folder / WEIGHTS_FILE)
    except (OSError, SafetensorError) as error:
        raise DataError(f"unreadable {folder / WEIGHTS_FILE}: {error}") from error
    try:
        shape = config["model"]
        model = StackedExperts(shape["num_experts"], shape["width"], shape["embed_dim"], shape["num_layers"],
                               HeadMode(shape["head"]), shape["time_chunk"])
        unknown = sorted(name for name in tensors if not name.startswith((_MODEL, _ROUTER)))
        if unknown:
            raise ValueError(f"unknown tensor {unknown[0]!r}")
        model.load_state_dict(_part(tensors, _MODEL))
        router = _router(config["router"], tensors)
        if router is not None and router.num_experts != model.num_experts:
            raise ValueError(f"a router of {router.num_experts} centroids for {model.num_experts} experts")
        return ExportedModel(model, router, int(config["top_k"]), int(config["score_from"])).eval()
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise DataError(f"{folder}: {WEIGHTS_FILE} does not fit {CONFIG_FILE}: "
                        f"{type(error).__name__}: {lines[-1] if lines else ''}") from error


def _part(tensors: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {name.removeprefix(prefix): value for name, value in tensors.items() if name.startswith(prefix)}


def _router(described: Mapping | None, tensors: Mapping[str, Tensor]) -> Router | None:
    """The router `config.json` describes, with its tensors; None when it describes none (and none is stored)."""
    if described is None:
        if _part(tensors, _ROUTER):
            raise ValueError(f"router tensors stored but {CONFIG_FILE} describes no router")
        return None
    encoder = encoder_from_saved(described["encoder"], described["encoder_config"], _part(tensors, _ENCODER))
    return Router(encoder, tensors[_ROUTER + "centroids"], described["sharding"])
