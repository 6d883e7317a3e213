"""The staging folder of a `prepare` or `shard` build, and running its chain of stages there.

A build runs in a staging folder beside its output, named after the build's fingerprint and task
count: datatrove's completion markers there let a killed run resume where it stopped, and the
output appears only when the last stage renames the finished folder into place. Builds of one
folder take turns (`soma_pl.locks.build_lock`); `check_unchanged` refuses to replace what another
wrote there while one waited.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from soma_pl.data.runner.executor import ExecutorConfig, ExecutorKind
from soma_pl.data.runner.pipeline import run_stages
from soma_pl.errors import ConfigError, DataError, SomaError
from soma_pl.io import write_error, write_json_atomic

STAGING_MARKER = ".soma_pl-staging.json"


def check_unchanged(output: Path, setting: str, before: str | None, now: str | None, fingerprint: str) -> None:
    """Refuse to replace what another command built in `output` while this one waited for its turn
    (`soma_pl.locks.build_lock`): `before` and `now` are the fingerprints of the build the folder held
    then and holds now (None: none), `fingerprint` this command's, which `now` is not.

    Raises:
        ConfigError: naming `setting` and `output`, when the folder holds another build than before.
    """
    if now is not None and now != before:
        raise ConfigError(f"{setting}={output}: while this command waited for its turn, another one built it with "
                          f"other settings (fingerprint {now[:12]}; this one builds {fingerprint[:12]}): to keep "
                          f"that, choose another {setting}; to replace it, run this command again")


def run_build(config: ExecutorConfig, output: Path, purpose: str, setting: str, fingerprint: str,
              make_stages: Callable[[Path], list[tuple[str, object]]], finished: Callable[[], bool]) -> bool:
    """Stage and run a build of `output`: the staging folder of `fingerprint` at the configured
    task count, the chain of stages `make_stages(stage)` returns, run by `run_chain`; True when the
    output is finished here.

    Raises:
        SomaError: as `run_chain`; also one line when the disk refuses the staging folder.
    """
    stage = staging_path(output, purpose, fingerprint, config.task_count())
    try:
        staging_folder(stage, output, purpose, fingerprint, config.task_count())
        stages = make_stages(stage)
    except OSError as error:
        refused = write_error(error, [stage, output], f"{setting}={output}", f"choose another {setting}")
        if refused is None:
            raise
        remove_staging(output, purpose)
        raise refused from error
    return run_chain(stages, config, stage, output, purpose, setting, finished)


def run_chain(stages: list[tuple[str, object]], config: ExecutorConfig, stage: Path, output: Path, purpose: str,
              setting: str, finished: Callable[[], bool]) -> bool:
    """Run a chain of stages; True when the output is finished here (a Slurm or Ray run may still
    be going: False, run the command again once it is done).

    Raises:
        SomaError: one line when the disk refused a write (nothing is kept), or a task failed (its
            finished siblings stay in the staging folder, so running the command again resumes).
    """
    if not finished():  # a finished build whose output was removed since: its last stage writes it again
        shutil.rmtree(stage / "logs" / stages[-1][0] / "completions", ignore_errors=True)
    try:
        run_stages(stages[-1][1])
    except (OSError, SomaError) as error:
        refused = refused_write(error, [stage, output], f"{setting}={output}", setting)
        if refused is None:
            raise  # the finished tasks stay in the staging folder: running the command again resumes
        remove_staging(output, purpose)  # the disk refused a write: keep nothing, as the line says
        raise refused from error
    if ExecutorKind(config.kind) is not ExecutorKind.local and not finished():
        return False
    for name, executor in stages:
        check_stage(stage / "logs" / name, executor.world_size, f"{purpose} {name}")
    return True


def refused_write(error: BaseException, targets: list[Path], what: str, setting: str) -> SomaError | None:
    """The one line for `error` when it is the disk refusing a write under `targets` (raised by a
    stage as an OSError, or already translated by `atomic_folder`), else None."""
    cause = error if isinstance(error, OSError) else error.__cause__
    if not isinstance(cause, OSError):
        return None
    translated = write_error(cause, targets, what, f"choose another {setting}")
    if translated is None or isinstance(error, OSError):
        return translated
    return error


def incomplete_tasks(logging_dir: Path, tasks: int) -> list[int]:
    """The tasks of a stage without datatrove's completion marker."""
    return [rank for rank in range(tasks) if not (logging_dir / "completions" / f"{rank:05d}").is_file()]


def staging_path(output: Path, purpose: str, fingerprint: str, tasks: int) -> Path:
    """The staging folder of a build: beside `output`, named after its fingerprint and task count,
    so a rerun of the same build finds its finished tasks, and a changed build or another task
    count (each task's share of the documents differs) starts afresh."""
    return output.parent / f".{output.name}.{purpose}-{fingerprint[:16]}-t{tasks}"


def staging_folder(folder: Path, output: Path, purpose: str, fingerprint: str, tasks: int) -> Path:
    """Make the staging folder `folder` (see `staging_path`) with its marker."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / STAGING_MARKER
    if not marker.is_file():
        write_json_atomic(marker, {"tool": "soma_pl", "kind": f"{purpose} staging", "output": str(output),
                                   "fingerprint": fingerprint, "tasks": tasks})
    return folder


def remove_staging(output: Path, purpose: str) -> None:
    """Remove every staging folder of `purpose` beside `output` that soma_pl wrote."""
    for folder in output.parent.glob(f".{output.name}.{purpose}-*"):
        if _is_staging(folder):
            shutil.rmtree(folder, ignore_errors=True)


def _is_staging(folder: Path) -> bool:
    try:
        marker = json.loads((folder / STAGING_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("tool") == "soma_pl"


def check_stage(logging_dir: Path, tasks: int, stage: str) -> None:
    """Raise when a finished local stage left tasks without completion markers."""
    missing = incomplete_tasks(logging_dir, tasks)
    if missing:
        raise DataError(f"{stage}: tasks {missing[:5]} did not finish (see {logging_dir / 'logs'}): run the command "
                        "again to resume")
