"""Checkpoints written atomically and read with `weights_only=True` (DESIGN §5, Errors).

Lightning's own writer stages a checkpoint in `$TMPDIR` and moves it into place; when the checkpoint
folder is on another filesystem that move is a copy, so a process killed (or a disk filling up)
during it leaves a truncated file under the checkpoint's name. `AtomicCheckpointIO` writes the
bytes to a hidden temporary file in the checkpoint's own folder, syncs them to disk and renames the
file into place: a reader sees the old checkpoint or the new one, never part of one. A failed write
removes its temporary file; one left by a killed process is removed by the next save in that folder
(`soma_pl.io.remove_stale_temporaries`), and when `--ckpt_path last` picks the checkpoint to resume.
Reading a checkpoint with pickle (`--weights_only false`, for a file soma_pl did not write) stays
possible, with a warning naming the file: such a file can run any code.
"""

from __future__ import annotations

import errno
import io
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from soma_pl.errors import DataError
from soma_pl.io import remove_stale_temporaries, write_atomic
from soma_pl.models.checkpoints import load_checkpoint

FIXES = {
    errno.ENOSPC: "free space there or set --checkpoint.dirpath to a folder on a disk with room",
    errno.EDQUOT: "free space there or set --checkpoint.dirpath to a folder on a disk with room",
    errno.EFBIG: "raise the file size limit (ulimit -f) or set --checkpoint.dirpath to a folder that allows the size",
    errno.EROFS: "set --checkpoint.dirpath (and --trainer.default_root_dir) to a writable folder",
    errno.EACCES: "set --checkpoint.dirpath (and --trainer.default_root_dir) to a folder you may write",
}


def write_error(error: OSError, path: Path) -> DataError:
    """One line naming the checkpoint, the reason and the setting that fixes it."""
    fix = FIXES.get(error.errno, "check that folder, or set --checkpoint.dirpath to another one")
    reason = error.strerror or str(error)
    return DataError(f"cannot write checkpoint {path}: {reason} (Errno {error.errno}) in {path.parent}: {fix}; "
                     "no partial checkpoint was left")


def _is_local(path: Any) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` that writes local checkpoints atomically and reads every checkpoint with
    `weights_only=True` unless `weights_only=False` is asked for explicitly."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)  # remote: Lightning's transaction
            return
        path = Path(str(path).removeprefix("file://"))
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(path.parent)
            write_atomic(buffer.getbuffer(), path)
        except OSError as error:
            raise write_error(error, path) from error

    def load_checkpoint(self, path: Any, map_location: Any = "cpu", weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is False:  # the user's explicit opt-in (`--weights_only false`): kept, and said aloud
            # Attributed to this file: Lightning prints warnings from its own files as `path:line: ...`.
            warnings.warn(f"--weights_only false: loading {path} with pickle, which runs any code the file holds; "
                          "use it only for a checkpoint you trust", stacklevel=1)
        if weights_only is False or not _is_local(path):
            return super().load_checkpoint(path, map_location=map_location,
                                           weights_only=weights_only if weights_only is not None else True)
        return load_checkpoint(str(path).removeprefix("file://"), map_location=map_location)
