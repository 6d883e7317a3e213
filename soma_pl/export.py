"""`export`: a checkpoint's weights as `model.safetensors` and `config.json`, loadable without Lightning.

Every method's checkpoint exports: the stacked experts (every expert of an ensemble), and the
router of a routed one (SOMA, BPTT with N > 1), which must then be in the checkpoint or given with
`--router`. `soma_pl.models.export` describes the two files and reads them back (`load_exported`,
plain torch). The folder is built under a temporary name and swapped in (`soma_pl.io.atomic_folder`),
so no reader sees half of one, and only a folder that soma_pl exported (its marker proves it) is
ever replaced.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from soma_pl.io import atomic_folder, check_output, folder_lock
from soma_pl.lit.loading import ensemble_router, ensemble_size, load_module
from soma_pl.models.checkpoints import load_checkpoint, trained_on
from soma_pl.models.export import WEIGHTS_FILE, save_exported

EXPORT_KIND = "exported model"
"""The kind an export folder's marker records: only such a folder is replaced by another export."""


def _settings(hyper_parameters: dict) -> dict:
    """The module's settings as JSON values (LightningCLI's own `_` keys left out)."""
    kept = {key: value for key, value in hyper_parameters.items() if not key.startswith("_")}
    return json.loads(json.dumps(kept, default=str))


def export(checkpoint: str, out: str | Path, config: str | None = None, router: str | None = None) -> dict:
    """Export `checkpoint` into the folder `out`; returns its `config.json` (see the module doc)."""
    out, inputs = Path(out).expanduser(), [checkpoint, config, router]
    check_output(out, EXPORT_KIND, "--out", inputs)  # before the checkpoint is read
    module = load_module(checkpoint, config, router)
    payload = load_checkpoint(checkpoint)
    extra = {"method": module.method, "module": f"soma_pl.lit.{type(module).__name__}",
             "settings": _settings(dict(payload.get("hyper_parameters") or {})), "data": trained_on(payload),
             "checkpoint": str(checkpoint), "global_step": payload.get("global_step")}
    with atomic_folder(out, EXPORT_KIND, "--out", inputs) as work:
        return save_exported(work, module.model, ensemble_router(module), ensemble_size(module, None),
                             module.score_from, extra)


# `out` is a `Path`: the command line checks a `str` out as a file to write; this folder is checked by
# `atomic_folder` (`check_output`) instead.
def main(checkpoint: str, out: Path, config: str | None = None, router: str | None = None) -> None:
    """Write a checkpoint's weights and settings as model.safetensors and config.json (no Lightning to load).

    Args:
        checkpoint: a Lightning checkpoint (.ckpt) of any soma_pl module.
        out: the folder to write (created, or replaced when an earlier export wrote it).
        config: the fit YAML naming the module; None: the checkpoint's own hyperparameters.
        router: router.pt for a SOMA checkpoint that carries none.
    """
    with folder_lock(Path(out).expanduser(), "--out"):  # a second export into it at once is refused
        written = export(checkpoint, out, config, router)
    parameters = sum(math.prod(shape) for name, shape in written["tensors"].items() if name.startswith("model."))
    routed = " and its router" if written["router"] else ""
    print(f"wrote {out}: {WEIGHTS_FILE} ({written['model']['num_experts']} expert(s), {parameters:,} parameters"
          f"{routed}) and config.json", file=sys.stderr)
