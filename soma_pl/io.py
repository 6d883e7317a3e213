"""Atomic writes and the folders soma_pl owns.

A file is written under a temporary name beside its target, then renamed. A folder is built under a
temporary name beside its target and swapped in; a marker file inside it (`.soma_pl-output.json`:
its kind, who wrote it and every file it holds, sub-folders included) proves that soma_pl wrote it.
Only such a folder is ever replaced: never one without the marker (whatever else it holds), one
that is, holds or lies inside an input, nor one that holds a file the marker does not list.

The locks that keep two commands from writing one folder are in `soma_pl.locks`.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from soma_pl.errors import ConfigError, DataError, SomaError

OUTPUT_MARKER = ".soma_pl-output.json"
LOCK_FILE = ".soma_pl.lock"
"""The lock of a folder being written: inside it (`folder_lock`), or after `.<name>` beside a folder
being built (`build_lock`)."""
_LEFTOVER = re.compile(r"(?P<stage>tmp|old)-(?P<pid>\d+)")


def write_json_atomic(path: str | Path, payload: dict) -> Path:
    """Write `payload` as indented JSON to `path` so that a reader sees the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic((json.dumps(payload, indent=2) + "\n").encode(), path)
    return path


def emit_json(result: dict, out: str | Path) -> Path:
    """A command's JSON result: written atomically to `out`, printed on stdout, the path on stderr."""
    path = write_json_atomic(Path(out), result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return path


def markdown_cell(text: str) -> str:
    """`text` as one cell of a markdown table row: `|` escaped, line breaks as spaces."""
    return " ".join(text.splitlines()).replace("|", "\\|")


TEMPORARY = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)$")
"""A temporary file of `write_atomic`: `.<name>.tmp-<host>-<pid>`, beside the file it becomes."""


def machine() -> str:
    """Where this process's PID means something: the host name and, where Linux tells it, the PID
    namespace, so two containers of one host name that do not see each other's processes differ."""
    try:
        return f"{socket.gethostname()}.pidns{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return socket.gethostname()


def temporary_path(path: Path) -> Path:
    """`.<name>.tmp-<host>-<pid>` beside `path`: which machine (`machine`) and process is writing it."""
    return path.with_name(f".{path.name}.tmp-{machine()}-{os.getpid()}")


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Remove the temporary files that processes of this machine left in `folder` when they were
    killed; another machine's (a shared filesystem, another container's PID namespace) may still be
    writing and are kept, and one that cannot be removed (a read-only folder, another user's) stays
    for a later pass."""
    removed, host = [], machine()
    for entry in folder.iterdir() if folder.is_dir() else ():
        match = TEMPORARY.match(entry.name)
        if match and match["host"] == host and not process_alive(int(match["pid"])):
            with suppress(OSError):
                entry.unlink()
                removed.append(entry)
    return removed


def write_atomic(data: bytes | memoryview | Sequence[bytes | memoryview], path: Path) -> None:
    """Write `data` (or its chunks, one after another) to `path` by a synced temporary file in the
    same folder and a rename; on any failure the temporary file is removed and `path` is untouched."""
    temporary = temporary_path(path)
    chunks = (data,) if isinstance(data, bytes | bytearray | memoryview) else data
    try:
        with open(temporary, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with suppress(OSError):
            temporary.unlink()
        raise
    # The rename itself reaches the disk when the folder is synced (some filesystems refuse).
    with suppress(OSError):
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def write_error(error: OSError, targets: Iterable[Path], what: str, remedy: str) -> SomaError | None:
    """One line for a write the file system refused (None for other errors, which stay tracebacks).

    Args:
        error: what the write raised.
        targets: the files or folders being written. A permission error on a path neither inside
            nor above one of them (an input being read) is not a write error.
        what: the start of the line, naming the setting or file (`dataset.output_dir=/x`).
        remedy: what to do besides freeing space (`choose another dataset.output_dir`).
    """
    code = error.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        return DataError(f"{what}: {os.strerror(code).lower()} (Errno {code}): free space there or {remedy}; "
                         "nothing half-written was kept")
    if code == errno.EROFS:
        return ConfigError(f"{what}: read-only file system (Errno {code}): {remedy} on a writable disk")
    if code in (errno.EACCES, errno.EPERM) and error.filename:
        written = Path(error.filename).absolute()
        if any(written.is_relative_to(t) or t.is_relative_to(written) for t in map(Path.absolute, targets)):
            return ConfigError(f"{what}: permission denied on {written} (Errno {code}): {remedy} that you can write")
    return None


def close_quietly(resources: Iterable) -> None:
    """Close each resource after a failure, ignoring what closing raises: its output is discarded,
    and an open tar stream would otherwise flush itself at exit (onto a full disk) with a traceback."""
    for resource in resources:
        with suppress(Exception):
            resource.close()


def read_marker(folder: Path) -> dict | None:
    """The marker of a folder soma_pl wrote, or None (no marker, or one that is not soma_pl's)."""
    try:
        marker = json.loads((Path(folder) / OUTPUT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("tool") == "soma_pl" else None


def check_apart(output: str | Path, setting: str, inputs: Iterable[str | Path | None]) -> None:
    """Refuse an output (file or folder) that is, holds or lies inside one of a command's `inputs`
    (files or folders; None skipped), after resolving symlinks; a hard link to an input is the input.

    Raises:
        ConfigError: naming `setting`, `output` and the input.
    """
    output = Path(output).expanduser()
    target = output.resolve()
    for item in filter(None, inputs):
        source = Path(item).expanduser().resolve()
        same = target == source or (target.exists() and source.exists() and os.path.samefile(target, source))
        relation = ("is" if same else "holds" if source.is_relative_to(target)
                    else "lies inside" if target.is_relative_to(source) else None)
        if relation:
            harm = "the output would mix with it" if relation == "lies inside" else "writing it destroys the input"
            raise ConfigError(f"{setting}={output} {relation} the input {item} ({harm}): choose another {setting} "
                              "apart from the inputs")


def check_output(output: Path, kind: str, setting: str, inputs: Iterable[str | Path] = ()) -> None:
    """Refuse an output folder that a build of `kind` may not replace.

    Args:
        output: the folder to build.
        kind: what soma_pl builds there (`prepared dataset`); a folder of another kind is refused.
        setting: the option naming `output`, for the message (`dataset.output_dir`).
        inputs: files and folders the build reads (see :func:`check_apart`).

    Raises:
        ConfigError: `output` is, holds or lies inside an input, or lies under a regular file; or it
            exists, is not empty and its marker does not prove that soma_pl wrote it as a `kind`
            with every file it holds now.
    """
    output = Path(output).expanduser()
    check_apart(output, setting, inputs)
    if not (output.exists() or output.is_symlink()):
        existing_folder(output, setting)
        return
    if not output.is_dir():
        raise ConfigError(f"{setting}={output} is a file, not a folder soma_pl wrote: choose another path")
    marker = read_marker(output)
    if marker is None:
        if any(entry.name != LOCK_FILE for entry in output.iterdir()):
            raise ConfigError(f"{setting}={output} exists and soma_pl did not write it (no {OUTPUT_MARKER}): "
                              "choose a new folder, or empty or remove this one yourself")
        return  # empty: nothing to lose
    if marker.get("kind") != kind:
        raise ConfigError(f"{setting}={output} holds a {marker.get('kind')}, not a {kind}: choose another folder")
    written = marker.get("files")
    if not isinstance(written, list):  # an unfinished build's, or an older soma_pl's (top-level names only)
        raise ConfigError(f"{setting}={output}: its {OUTPUT_MARKER} does not list the files soma_pl wrote there "
                          "(an older soma_pl), so files of yours in its sub-folders would be lost: move out "
                          "anything of yours and remove the folder, or choose another folder")
    try:
        foreign = sorted(set(folder_files(output)) - set(written))
    except OSError as error:
        raise ConfigError(f"{setting}={output}: cannot list {error.filename} ({error.strerror}), so it may hold files "
                          "of yours: choose another folder") from error
    if foreign:
        listed = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(f"{setting}={output} holds files soma_pl did not write ({listed}): move them out "
                          "or choose another folder")


def folder_files(folder: Path) -> list[str]:
    """Every file (and link) under `folder`, sub-folders included, as a relative POSIX path; the
    marker and the lock (`folder_lock`) left out."""
    files, pending = [], [""]
    while pending:
        prefix = pending.pop()
        with os.scandir(Path(folder) / prefix) as entries:
            for entry in entries:
                name = prefix + entry.name
                if entry.is_dir(follow_symlinks=False):
                    pending.append(name + "/")
                elif name not in (OUTPUT_MARKER, LOCK_FILE):
                    files.append(name)
    return sorted(files)


def remove_leftovers(output: Path) -> list[Path]:
    """Remove the `.<name>.tmp-<pid>` and `.<name>.old-<pid>` entries beside `output` that
    processes now gone left behind (a killed build); return what was removed.

    A temporary folder whose marker names another machine (`machine`) is kept: its process may be alive there.
    """
    output = Path(output).expanduser()
    prefix, removed = f".{output.name}.", []
    try:
        entries = [entry for entry in output.parent.iterdir() if entry.name.startswith(prefix)]
    except OSError:
        return removed
    for entry in entries:
        match = _LEFTOVER.fullmatch(entry.name[len(prefix):])
        if match is None or process_alive(int(match["pid"])):
            continue
        marker = read_marker(entry) if match["stage"] == "tmp" else None
        if marker is not None and marker.get("host") not in (None, machine()):
            continue
        _remove(entry)
        if not (entry.exists() or entry.is_symlink()):
            removed.append(entry)
            warnings.warn(f"removed {entry}: left by process {match['pid']}, which is gone", stacklevel=3)
    return removed


@contextmanager
def atomic_folder(output: Path, kind: str, setting: str, inputs: Iterable[str | Path] = ()) -> Iterator[Path]:
    """Build a folder under a temporary name beside `output`; when the block ends without error,
    the new folder replaces `output` by renames, so no reader ever sees a half-written folder.

    `output` must pass :func:`check_output` (arguments as there), on entry and again before the
    swap. Leftovers of killed builds beside it are removed first. A failed build leaves nothing; a
    killed one only a hidden `.<name>.tmp-<pid>` folder, which the next build removes.

    Raises:
        ConfigError: see :func:`check_output`; or the folder is read-only or not writable.
        DataError: the disk filled up.
    """
    output = Path(output).expanduser()
    inputs = list(inputs)
    check_output(output, kind, setting, inputs)
    work = output.parent / f".{output.name}.tmp-{os.getpid()}"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(output)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        _write_marker(work, kind, files=None)
        yield work
        _write_marker(work, kind, files=folder_files(work))
        check_output(output, kind, setting, inputs)  # a long build: look again before replacing
        _swap(work, output)
    except OSError as error:
        translated = write_error(error, [work, output], f"{setting}={output}", f"choose another {setting}")
        if translated is None:
            raise
        raise translated from error
    finally:
        shutil.rmtree(work, ignore_errors=True)


def tag_marker(folder: Path, **fields: str) -> None:
    """Add `fields` to the marker of a folder soma_pl built (what built it, say): the marker is
    soma_pl's own file, so its file list is unchanged."""
    marker = read_marker(folder)
    if marker is not None:
        write_json_atomic(Path(folder) / OUTPUT_MARKER, {**marker, **fields})


def _write_marker(folder: Path, kind: str, files: list[str] | None) -> None:
    write_json_atomic(folder / OUTPUT_MARKER, {
        "tool": "soma_pl", "kind": kind, "files": files, "host": machine(), "pid": os.getpid(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })


def _swap(work: Path, output: Path) -> None:
    """Put `work` in place of `output` (which may not exist); the old folder is removed."""
    old = output.parent / f".{output.name}.old-{os.getpid()}"
    _remove(old)
    had_old = output.exists() or output.is_symlink()
    if had_old:
        os.replace(output, old)
    try:
        os.replace(work, output)
    except OSError:
        if had_old:
            os.replace(old, output)
        raise
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(OSError):
            path.unlink(missing_ok=True)


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this machine exists (a zombie or another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def existing_parent(path: str | Path) -> Path:
    """The nearest parent of `path` that exists (the root always does)."""
    return next(parent for parent in Path(path).absolute().parents if parent.exists())


def existing_folder(path: Path, setting: str) -> Path:
    """The nearest existing parent of `path`, where it would be created; refused when that is a
    regular file (nothing could be created under it)."""
    folder = existing_parent(path)
    if not folder.is_dir():
        raise ConfigError(f"{setting}={path}: {folder} is a file, not a folder: choose another path")
    return folder


def check_output_file(path: str | Path, setting: str = "--out") -> None:
    """Refuse, before any work, a file a command could not write when it ends: a folder, a path
    under a regular file, or one on a read-only disk or in a folder you may not write.

    Raises:
        ConfigError: naming `setting` and what to do.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"{setting}={path} is a folder: give a file name (such as {path / 'result.json'})")
    folder = existing_folder(path, setting)
    refused = (errno.EROFS if os.statvfs(folder).f_flag & os.ST_RDONLY
               else errno.EACCES if not os.access(folder, os.W_OK | os.X_OK) else None)
    if refused is not None:
        error = OSError(refused, os.strerror(refused), str(folder))
        raise write_error(error, [path], f"{setting}={path}", f"choose another {setting}")
