"""Locks on the folders a command writes, and the processes it starts.

A command writing a folder holds it, so that two commands never write one folder at once: a `fit`
or an export refuses a second writer with one line (`folder_lock`: an advisory lock on the hidden
file `.soma_pl.lock` inside the folder); builds of a dataset take turns (`build_lock`: the hidden
file `.<name>.soma_pl.lock` beside it, so that no output folder appears before its build is done).
A child process started by a command dies with it (`die_with_parent`).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from soma_pl.errors import ConfigError
from soma_pl.io import LOCK_FILE

_HELD: set[Path] = set()
"""The folders this process holds (`folder_lock`, `build_lock`)."""


@contextmanager
def folder_lock(folder: Path, setting: str) -> Iterator[Path]:
    """Hold `folder` (made when missing) while a command writes it: a second command writing it at
    the same time is refused, instead of mixing its files with this one's or replacing them.

    The lock is `flock` on `LOCK_FILE` inside the folder, removed when the block ends (with the
    folder, when it was made here and is still empty). The kernel releases it when the process
    dies, however it dies: a killed command leaves at most the file, which blocks nobody and is no
    data (`check_output` and `folder_files` leave it out). Forked workers share the lock; processes
    started anew do not (a multi-process run takes it in its launching process only). A folder
    that `atomic_folder` replaces sheds the file, and with it the lock, when its build is complete.
    Where no lock can be taken (a folder that cannot be created or written, a file system without
    locks) the command goes on unlocked, and its own checks refuse what it cannot write.

    Args:
        folder: the folder the command writes.
        setting: the option naming it, for the message (`--trainer.default_root_dir`).

    Raises:
        ConfigError: another process holds the folder, naming `setting`, the folder and the holder;
            or this process does.
    """
    folder = Path(folder).expanduser()
    made = not (folder.exists() or folder.is_symlink())
    with suppress(OSError):  # where it cannot be made, no lock is taken (see above)
        folder.mkdir(parents=True, exist_ok=True)
    try:
        with _locked(folder, folder / LOCK_FILE, setting, wait=False):
            yield folder
    finally:
        if made:
            with suppress(OSError):
                folder.rmdir()  # only when empty: a command that wrote nothing leaves nothing


@contextmanager
def build_lock(output: Path, setting: str) -> Iterator[None]:
    """Wait for any other process building `output`, then hold it until the block ends: processes
    building one folder at once (`prepare` and `shard` commands, the fits of a sweep's first trials
    preparing a missing dataset) take turns, and a build rereads what the folder holds once its
    turn comes.

    The lock is `flock` on `.<name>.soma_pl.lock` beside the output (its resolved path), where
    the build's staging folder is, so it never makes the output: a killed build leaves no folder
    that could read as its output, only a lock file that blocks nobody and that the next build of
    the folder removes. The folder above the output is made when missing. Where no lock can be
    taken the build goes on unlocked, as in `folder_lock`.

    Raises:
        ConfigError: this process already holds `output` (it would wait for itself).
    """
    output = Path(output).expanduser()
    where = output.resolve()
    with suppress(OSError):
        where.parent.mkdir(parents=True, exist_ok=True)
    with _locked(output, where.parent / f".{where.name}{LOCK_FILE}", setting, wait=True):
        yield


@contextmanager
def _locked(folder: Path, path: Path, setting: str, wait: bool) -> Iterator[None]:
    """Hold the lock file `path` of `folder` while the block runs (see `folder_lock`, `build_lock`)."""
    key = folder.resolve()
    if key in _HELD:
        raise ConfigError(f"{setting}={folder} is also a folder this command writes under another setting: choose "
                          f"another {setting}")
    handle = _take_lock(folder, path, setting, wait)
    if handle is None:
        yield
        return
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)
        with suppress(OSError):  # removed while still held, so no one locks a file that is gone
            if _same_file(handle, path):  # after `atomic_folder`'s swap the file there is another's, or none
                path.unlink()
        os.close(handle)


def _take_lock(folder: Path, path: Path, setting: str, wait: bool) -> int | None:
    """The descriptor of the lock taken on `path`, or None when none can be."""
    warned = False
    while True:
        try:
            handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy = f"{setting}={folder} is being written by another soma_pl command{_holder(path)}"
                if not wait:
                    raise ConfigError(f"{busy}: wait for it to end, or choose another {setting}") from None
                if not warned:
                    warnings.warn(f"{busy}: waiting for it to end", stacklevel=2)
                    warned = True
                fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            os.close(handle)
            return None
        except BaseException:
            os.close(handle)
            raise
        if _same_file(handle, path):
            break
        os.close(handle)  # the holder removed that file when it ended: lock the file there now
    with suppress(OSError):
        os.ftruncate(handle, 0)
        os.write(handle, json.dumps({"tool": "soma_pl", "pid": os.getpid(), "host": socket.gethostname()}).encode())
    return handle


def _same_file(handle: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(handle), os.stat(path))
    except OSError:
        return False


def _holder(path: Path) -> str:
    """` (process <pid> on <host>)`: who holds the lock at `path`, as its file says ("" before it says)."""
    try:
        holder = json.loads(path.read_text())
        return f" (process {int(holder['pid'])} on {holder['host']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """What a child process calls first to be SIGKILLed by the kernel when its parent dies (Linux
    `PR_SET_PDEATHSIG`; None elsewhere). It ends the child at once if `parent` died before the
    request was made. A killed command then leaves no worker or child running on its folders."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up in the parent: the child only calls it

    def request() -> None:
        prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return request
