"""Validation loss against three measures of compute, one line per run, as one PNG.

The panels share the loss axis: updates, forward multiply-adds (token-forwards × parameters per
expert: equal arithmetic, Table 11's basis) and update time (`U · Σₑ t̄ₑ`: equal measured time,
Table 3's). Each axis picks a readable unit from its largest value.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from soma_pl.io import write_atomic

SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")


@dataclass(frozen=True)
class Axis:
    """One panel's horizontal axis."""

    key: str
    """The curve point's field drawn along it."""
    label: str
    """Its name, before the unit."""
    kind: str
    """`count` (no unit), `power` (a power of 10³ as the unit) or `time` (seconds, minutes or hours)."""


AXES = (Axis("updates", "updates", "count"),
        Axis("multiply_adds", "forward multiply-adds ≈ token-forwards × parameters per expert", "power"),
        Axis("update_seconds", "update time U·Σₑ t̄ₑ", "time"))
"""The three panels, left to right."""


def axis_unit(axis: Axis, largest: float) -> tuple[float, str]:
    """`(divisor, label)` for `axis` when its largest value is `largest`."""
    if axis.kind == "power" and largest > 0:
        exponent = 3 * math.floor(math.log10(largest) / 3)
        return 10.0 ** exponent, f"{axis.label} (10{str(exponent).translate(SUPERSCRIPT)})"
    if axis.kind == "time":
        divisor, unit = (1, "s") if largest < 120 else (60, "minutes") if largest < 7200 else (3600, "hours")
        return divisor, f"{axis.label} ({unit})"
    return 1.0, axis.label


def draw_loss_curves(curves: Mapping[str, Sequence[Mapping[str, float | None]]], path: str | Path, title: str,
                     ylabel: str = "ensemble-validation loss (nats/byte)") -> Path:
    """Draw `curves` (label → points, each a mapping with `val_loss` and every `AXES` key) and write
    the PNG atomically to `path`. A point whose value on an axis is None (a run without compute
    figures) is left out of that panel only. Points at update 0 (an untrained start, about ln 256)
    are drawn but left out of the loss range, which would otherwise flatten the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(AXES), figsize=(13, 3.8), sharey=True)
    for panel, axis in zip(axes, AXES, strict=True):
        values = [p[axis.key] for points in curves.values() for p in points if p.get(axis.key) is not None]
        divisor, label = axis_unit(axis, max(values, default=0))
        for name, points in curves.items():
            drawn = [p for p in points if p.get(axis.key) is not None]
            if drawn:
                panel.plot([p[axis.key] / divisor for p in drawn], [p["val_loss"] for p in drawn],
                           marker="o", ms=3, label=name)
        panel.set_xlabel(label)
        panel.grid(alpha=0.3)
        if panel.has_data():
            panel.legend(fontsize="small")
    trained = [p["val_loss"] for points in curves.values() for p in points
               if p.get("updates") and math.isfinite(p["val_loss"])]
    if trained:
        axes[0].set_ylim(min(trained) - 0.05, max(trained) + 0.05)
    axes[0].set_ylabel(ylabel)
    figure.suptitle(title)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(buffer.getvalue(), path)
    return path
