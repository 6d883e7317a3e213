"""`export`: a checkpoint as a Hugging Face-style model folder, loadable without Lightning.

The folder holds `model.safetensors` and `config.json` (`soma_pl.models.export`) and a model card,
`README.md`: the model, the method and its settings, the data it was trained on (fingerprints and
the run's data settings) and the scores known for this checkpoint (the losses its run's
`summary.json` records at the checkpoint's update). `ExportedModel.from_pretrained(folder)`
(`soma_pl.models.export`) loads it.

Every method's checkpoint exports: the stacked experts (every expert of an ensemble), and the
router of a routed one (SOMA, BPTT with N > 1), which must then be in the checkpoint or given with
`--router`. The folder is built under a temporary name and swapped in (`soma_pl.io.atomic_folder`),
so no reader sees half of one, and only a folder that soma_pl exported (its marker proves it) is
ever replaced.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from soma_pl.errors import ConfigError
from soma_pl.io import atomic_folder, check_output, write_atomic
from soma_pl.locks import folder_lock
from soma_pl.models.checkpoints import load_checkpoint, trained_on
from soma_pl.models.export import CARD_FILE, WEIGHTS_FILE, save_exported
from soma_pl.models.stacked import StackedExperts
from soma_pl.trainer_checks import RUN_SETTINGS_KEY

EXPORT_KIND = "exported model"
"""The kind an export folder's marker records: only such a folder is replaced by another export."""


def _settings(hyper_parameters: dict) -> dict:
    """The module's settings as JSON values (LightningCLI's own `_` keys left out)."""
    kept = {key: value for key, value in hyper_parameters.items() if not key.startswith("_")}
    return json.loads(json.dumps(kept, default=str))


def known_scores(checkpoint: Path, step: int | None) -> tuple[dict, str | None]:
    """The losses (`val/`, `test/`, `expert/`) that the `summary.json` of the checkpoint's run records
    at the checkpoint's update, and that file; `({}, None)` when no summary is of that update."""
    root = checkpoint.resolve().parent.parent  # checkpoints go to <default_root_dir>/checkpoints
    for path in [root / "summary.json", *sorted(root.glob("version_*/summary.json"))]:
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(summary, dict) and summary.get("global_step") == step:
            metrics = summary.get("metrics") or {}
            return {key: value for key, value in metrics.items() if key.startswith(("val/", "test/", "expert/"))}, \
                str(path)
    return {}, None


def model_card(config: dict) -> str:
    """`README.md` of an export: what `config.json` says, for a reader."""
    model, data = config["model"], config["data"]
    scores = "\n".join(f"| `{key}` | {value:.4f} |" for key, value in sorted(config["scores"].items()))
    scores = (f"Mean cross entropy in nats/byte (ln 256 = 5.545 is uniform), from `{config['scores_from']}`:\n\n"
              f"| metric | value |\n|---|---|\n{scores}") if scores else "None recorded for this checkpoint's update."
    router = (f"a router (top {config['top_k']} of {model['num_experts']} experts by the first "
              f"{config['route_bytes']} bytes)" if config["router"] else "no router")
    return f"""---
library_name: soma_pl
tags: [soma_pl, byte-level, language-model, zero-order, {config['method']}]
---
# {config['method'].upper()} byte-level language model (soma_pl)

A byte-level recurrent language model ({model['num_experts']} expert(s) of width {model['width']}, embedding
{model['embed_dim']}, {model['num_layers']} LSTM + MLP block(s), {model['head']} head, {router}), exported from
`{config['checkpoint']}` at update {config['global_step']} by soma_pl {config['soma_pl_version']}.

## Method

`{config['module']}` trained by `{config['method']}`; its settings:

```json
{json.dumps(config['settings'], indent=2, sort_keys=True)}
```

## Data

Fingerprints of the prepared dataset and sharding it was trained on: `{json.dumps(data, sort_keys=True)}`.
Its data settings: `{json.dumps(config['data_settings'], sort_keys=True)}`.

## Scores

{scores}

## Use

```python
from soma_pl.models.export import ExportedModel

model = ExportedModel.from_pretrained("{config['folder']}")  # torch and safetensors only, in eval mode
logits = model(tokens)  # tokens [experts, batch, time] of bytes -> [experts, batch, time, 256]
```

or `python -m soma_pl.cli generate --checkpoint {config['folder']} --prompt "..."` and
`python -m soma_pl.cli evaluate --checkpoint {config['folder']} --text FILE`.
"""


def export(checkpoint: str, out: str | Path, config: str | None = None, router: str | None = None) -> dict:
    """Export `checkpoint` into the folder `out`; returns its `config.json` (see the module doc)."""
    out, inputs = Path(out).expanduser(), [checkpoint, config, router]
    check_output(out, EXPORT_KIND, "--out", inputs)  # before the checkpoint is read
    from soma_pl.lit.loading import ensemble_router, ensemble_size, load_module  # Lightning: only when run

    module = load_module(checkpoint, config, router)
    if not isinstance(module.model, StackedExperts):
        raise ConfigError(f"{checkpoint}: export writes the paper's LSTM experts; this {type(module).__name__} "
                          f"checkpoint is read as it is by validate, test, evaluate_text and generate")
    payload = load_checkpoint(checkpoint)
    scores, scores_from = known_scores(Path(checkpoint).expanduser(), payload.get("global_step"))
    extra = {"method": module.method, "module": f"soma_pl.lit.{type(module).__name__}",
             "settings": _settings(dict(payload.get("hyper_parameters") or {})), "data": trained_on(payload),
             "data_settings": (payload.get(RUN_SETTINGS_KEY) or {}).get("data"),
             "checkpoint": str(checkpoint), "global_step": payload.get("global_step"), "scores": scores,
             "scores_from": scores_from}
    with atomic_folder(out, EXPORT_KIND, "--out", inputs) as work:
        written = save_exported(work, module.model, ensemble_router(module), ensemble_size(module, None),
                                module.score_from, extra)
        write_atomic(model_card({**written, "folder": str(out)}).encode(), work / CARD_FILE)
        return written


# `out` is a `Path`: the command line checks a `str` out as a file to write; this folder is checked by
# `atomic_folder` (`check_output`) instead.
def main(checkpoint: str, out: Path, config: str | None = None, router: str | None = None) -> None:
    """Write a checkpoint as a model folder: model.safetensors, config.json and a model card (no Lightning to load).

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
          f"{routed}), config.json and {CARD_FILE}", file=sys.stderr)
