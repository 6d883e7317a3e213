"""`WindowLossWriter`: what `predict` writes — each scored window's loss under every expert.

`predict` runs the model over the test windows (`ByteDataModule.predict_dataloader`); the module's
`predict_step` returns `{"index": [b], "loss": [E, b]}` (nats/byte over the scored targets). When the
predict loop ends this writer puts one row per window into `--predictions.path`:

| column | type | meaning |
| --- | --- | --- |
| `window` | int | the window's index in the test set |
| `document`, `source`, `offset` | str, str, int | where the window was cut from (when the data module has them) |
| `expert_losses` | list of E floats | the window's scored loss under each expert (nats/byte) |
| `mean_expert_loss` | float | their mean (the loss itself when E = 1) |

The format follows the file's suffix: `.parquet` (pyarrow) or `.jsonl` (one JSON object a line).
A relative path is inside the run directory. Under several processes each rank writes its share to
`<stem>.rank<r><suffix>`. The file is written atomically.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from soma_pl.callbacks.compute import run_directory
from soma_pl.contracts import HoldsEvalSets
from soma_pl.errors import ConfigError
from soma_pl.eval.checks import check_finite
from soma_pl.io import write_atomic

FORMATS = (".parquet", ".jsonl")


class WindowLossWriter(BasePredictionWriter):
    """Writes `predict`'s per-window losses to parquet or JSONL.

    Args:
        path: output file, `.parquet` or `.jsonl`; relative paths are inside the run directory.
        enabled: write the file (false: `predict` only returns its predictions).
    """

    def __init__(self, path: str = "predictions.parquet", enabled: bool = True):
        super().__init__(write_interval="epoch")
        if Path(path).suffix not in FORMATS:
            raise ConfigError(f"--predictions.path {path}: the suffix must be one of {', '.join(FORMATS)}")
        self.path, self.enabled = path, enabled
        self.written: Path | None = None

    def output_path(self, trainer: L.Trainer) -> Path:
        path = Path(self.path)
        path = path if path.is_absolute() else run_directory(trainer) / path
        if trainer.world_size > 1:
            path = path.with_name(f"{path.stem}.rank{trainer.global_rank}{path.suffix}")
        return path

    def write_on_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Any,
                           batch_indices: Any) -> None:
        if not self.enabled:
            return
        rows = window_rows(predictions,
                           trainer.datamodule.test_set if isinstance(trainer.datamodule, HoldsEvalSets) else None)
        check_finite("the window losses", [row["expert_losses"] for row in rows],
                     f"checkpoint {trainer.ckpt_path}" if trainer.ckpt_path else "the configured model")
        path = self.output_path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(encode(rows, path.suffix), path)
        self.written = path
        print(f"predictions: {len(rows)} windows -> {path}", file=sys.stderr)


def window_rows(predictions: list[dict[str, torch.Tensor]], evalset: Any = None) -> list[dict]:
    """One row per window from `predict_step` outputs (`index [b]`, `loss [E, b]`), in window order;
    `evalset` (an `EvalSet`) adds each window's document, source and offset."""
    if predictions and isinstance(predictions[0], list):  # several predict dataloaders: the first
        predictions = predictions[0]
    rows = []
    for batch in predictions:
        losses = batch["loss"].detach().float().cpu().T  # [b, E]
        for index, window_losses in zip(batch["index"].tolist(), losses.tolist(), strict=False):
            row = {"window": int(index)}
            if evalset is not None:
                row.update(document=str(evalset.doc_ids[index]), source=str(evalset.sources[index]),
                           offset=int(evalset.offsets[index]))
            row.update(expert_losses=window_losses, mean_expert_loss=sum(window_losses) / len(window_losses))
            rows.append(row)
    return sorted(rows, key=lambda row: row["window"])


def encode(rows: list[dict], suffix: str) -> bytes:
    if suffix == ".jsonl":
        return "".join(json.dumps(row) + "\n" for row in rows).encode()
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    return buffer.getvalue()
