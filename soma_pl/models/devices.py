"""The torch device a setting names, or one line saying why it cannot be used here."""

from __future__ import annotations

import torch

from soma_pl.errors import ConfigError


def resolve_device(name: str | torch.device, setting: str) -> torch.device:
    """`torch.device(name)`, refused with one line naming `setting` when it is not a device or this
    machine's torch cannot use it (no CUDA, a CUDA index past the last GPU, no MPS).

    Raises:
        ConfigError: as above; the message suggests `cpu`.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"{setting}={name} is not a torch device (cpu, cuda, cuda:1, mps)") from error
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{setting}={name}: no CUDA device here (torch {torch.__version__}, "
                              f"CUDA {torch.version.cuda}); use {setting}=cpu")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{setting}={name}: this machine has {count} CUDA device(s), cuda:0-cuda:{count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{setting}={name}: MPS is not available here; use {setting}=cpu")
    return device
