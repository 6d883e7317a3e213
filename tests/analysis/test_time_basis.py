"""Equal measured update time: interpolation of a (seconds, loss) curve against hand-computed values,
and a side's standing at a budget."""

from __future__ import annotations

import pytest

from soma_pl.analysis.time_basis import equal_time_point, interpolate
from soma_pl.errors import SomaError

CURVE = [{"step": 0, "device_seconds": 0.0, "val_loss": 5.5}, {"step": 50, "device_seconds": 40.0, "val_loss": 3.5},
         {"step": 100, "device_seconds": 100.0, "val_loss": 3.0}]


def test_interpolation_is_linear_between_points_and_exact_at_the_ends():
    points = [(p["device_seconds"], p["val_loss"]) for p in CURVE]
    assert interpolate(points, 70.0) == pytest.approx(3.25)  # halfway from 40 s to 100 s
    assert interpolate(points, 10.0) == pytest.approx(5.0)
    assert interpolate([(0.430399, 2.9)], 0.430399 * (1 + 1e-12)) == 2.9  # a one-point curve at its own time
    with pytest.raises(SomaError, match="outside the curve's range"):
        interpolate(points, 101.0)


def test_a_side_is_scored_at_its_last_validation_within_the_budget():
    point = equal_time_point(CURVE, 70.0)
    assert (point.updates, point.seconds, point.val_interpolated) == (50, 40.0, pytest.approx(3.25))
    assert equal_time_point(CURVE, 100.0).updates == 100  # the faster side: all of its run
