"""The main job's two compute bases: equal arithmetic and equal update time.

The demo's sides run the same number of updates, which for its equal-size pair is equal
multiply-adds (Table 11's basis). The paper's Figs. 1, 7, 8 and Tables 4–7 equalise update time
instead (Table 3: U·Σₑ t̄ₑ, its hours estimated from recorded mean step times). On that basis both
sides are compared at `T`, the smaller of the two sides' total update times (updates × each side's
update time calibrated alone before the fits): each side's ensemble-validation curve is
interpolated at `T`, and each side's checkpoint at its last validation within `T` is scored in full
(ensemble validation and both test splits, with bootstrap intervals). The fits' own update times
are measured beside each other on a shared machine: the report keeps them, and the load average
they were measured under, beside the calibrated ones.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field


@dataclass
class LoadSampler:
    """The 1-minute load average, sampled every `every` seconds while the fits run."""

    every: float = 10.0
    samples: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> LoadSampler:
        def sample() -> None:
            while True:
                self.samples.append(round(os.getloadavg()[0], 2))
                if self._stop.wait(self.every):
                    return

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {"samples": 0}
        return {"samples": len(self.samples), "mean": round(sum(self.samples) / len(self.samples), 2),
                "max": max(self.samples)}
