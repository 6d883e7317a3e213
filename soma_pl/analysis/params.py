"""`analyze params`: Table 2's parameter counts, computed from the real modules."""

from __future__ import annotations

from soma_pl.io import emit_json
from soma_pl.models.counts import table2_rows


def main(out: str = "params.json") -> None:
    """Table 2: parameter counts computed from the real modules.

    Args:
        out: where to write the JSON.
    """
    emit_json({"analysis": "params", "table": "Table 2", "rows": table2_rows()}, out)
