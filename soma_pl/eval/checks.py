"""What every scoring command refuses: a count below one before the work, a non-finite loss after it.

A non-finite loss comes from weights that hold NaN or infinite values or overflow (a diverged run, a
damaged file); reported as a number, it would read as a result.
"""

from __future__ import annotations

import numpy as np
import torch

from soma_pl.errors import ConfigError, DataError

ALL_WHEN_UNSET = {"max_windows": "leave it unset to score every window"}
"""Count options whose unset value means "all", and how to say so."""


def check_counts(command: str, **counts: int | None) -> None:
    """Refuse a count option below 1 (`--max_windows 0` scores nothing, `-3` would cut windows off
    the end, `--batch_size 0` never ends); None passes (an option's "all").

    Raises:
        ConfigError: naming the first such option.
    """
    for name, value in counts.items():
        if value is not None and value < 1:
            hint = f" ({ALL_WHEN_UNSET[name]})" if name in ALL_WHEN_UNSET else ""
            raise ConfigError(f"{command}: --{name}={value} must be >= 1{hint}")


def check_finite(what: str, values: float | np.ndarray | torch.Tensor, source: str) -> None:
    """Refuse a loss (or losses) holding NaN or infinity before it is reported.

    Args:
        what: the result, for the message (`the window losses`, `test/loss`).
        values: a number or an array of any shape.
        source: the weights scored (`checkpoint x.ckpt`).

    Raises:
        DataError: some value is NaN or infinite.
    """
    array = values.detach().double().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values, float)
    bad = ~np.isfinite(array)
    if bad.any():
        count = f"are not finite ({int(bad.sum())} of {array.size})" if array.size > 1 else f"is {array.item()}"
        raise DataError(f"{what} of {source} {count}: its weights hold NaN or infinite values or overflow "
                        "(a diverged run): score a finite checkpoint; nothing was written")


def largest_weights(model) -> torch.Tensor:
    """`[E]` float64: each expert's largest weight magnitude, NaN or infinite when a weight is (a
    shared tensor counts for every expert). `model` is a `StackedExperts`.

    The infinity norm of each expert's rows: one pass over the weights, `[E]` allocated, not a
    tensor the size of the model.
    """
    largest = torch.zeros(model.num_experts, dtype=torch.float64, device=model.w_hh.device)
    for name, param in model.named_parameters():
        rows = param.detach().reshape(1 if model.is_shared(name) else model.num_experts, -1)
        norm = torch.linalg.vector_norm(rows, ord=float("inf"), dim=1).to(torch.float64)
        # `maximum` propagates NaN, so a NaN weight anywhere makes its expert's entry NaN.
        largest = torch.maximum(largest, norm)
    return largest
