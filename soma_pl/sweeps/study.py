"""The shared Optuna study of a sweep: storage, the grid queue, claiming trials, heartbeats.

Grid points are enqueued trials (`study.enqueue_trial`) carrying their point as the user attribute
`point`. A worker claims a WAITING trial by the storage's atomic WAITING → RUNNING transition, so two
workers never claim the same trial; a point enqueued twice (two workers starting at once on a server
database) is run once: the later claim is failed as `duplicate`. A claimed trial's worker writes a
heartbeat (system attribute) every `heartbeat_seconds`; a RUNNING trial whose heartbeat is older than
`stale_seconds` (its worker was killed) is failed as `stale`, and its point is enqueued again. A point
counts as done when it has a COMPLETE or PRUNED trial; one failed by its own error stays failed (with
its error) unless the runner is asked to retry failures.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import optuna
from filelock import FileLock
from optuna.exceptions import StorageInternalError, UpdateFinishedTrialError
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

from soma_pl.errors import ConfigError
from soma_pl.sweeps.space import PrunerKind, PrunerSpec, SweepSpec, point_key

HEARTBEAT = "soma_pl:heartbeat"
"""Trial system attribute: the worker's wall-clock time at its last heartbeat."""
SWEEP_ATTR = "soma_pl:sweep"
"""Study user attribute: the sweep's description (factors, seeds, report layout)."""


class FailureKind(str, Enum):
    """Why a trial is FAIL (user attribute `failure`)."""

    error = "error"
    """The fit failed: kept with its error, not re-run (unless `--retry-failed`)."""
    interrupted = "interrupted"
    """The worker was stopped (SIGINT/SIGTERM): its point is re-run."""
    stale = "stale"
    """The worker vanished (no heartbeat): its point is re-run."""
    duplicate = "duplicate"
    """The point already had a live or finished trial: skipped, never ran."""


RETRYABLE = {FailureKind.interrupted.value, FailureKind.stale.value, FailureKind.duplicate.value}


def default_storage(spec: SweepSpec) -> str:
    return f"sqlite:///{(spec.output_dir / 'optuna.db').resolve()}"


DRIVER_PACKAGES = {"psycopg": "'psycopg[binary]'", "psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient",
                   "pymysql": "PyMySQL", "mysql": "mysql-connector-python", "cx_Oracle": "cx_Oracle"}
"""The pip package of a database driver module whose name differs from the module's."""
STORAGE_FORMS = "sqlite:///PATH.db, postgresql://USER@HOST/DB, mysql://USER@HOST/DB, or a journal file path"


def _check_folder(file: Path, setting: str) -> None:
    # A mistyped folder is an error, not created: workers meant to share a study would not.
    if not file.parent.is_dir():
        raise ConfigError(f"{setting}: folder {file.parent} of {file.name} does not exist: create it or "
                          "name a file in an existing folder")


def check_storage(url: str, setting: str = "storage") -> None:
    """Refuse a storage Optuna cannot open with one line naming `setting`: an unknown URL scheme, a
    database driver that is not installed, or a SQLite or journal file whose folder does not exist."""
    if "://" not in url:
        _check_folder(Path(url).expanduser(), f"{setting} {url}")
        return
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as error:
        raise ConfigError(f"{setting} {url}: not a database URL Optuna can open; use {STORAGE_FORMS}") from error
    shown = parsed.render_as_string(hide_password=True)
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError as error:
        raise ConfigError(f"{setting} {shown}: not a database URL Optuna can open; use {STORAGE_FORMS}") from error
    try:
        # SQLAlchemy 2 imports the driver with `import_dbapi`, 1.4 with `dbapi`.
        (getattr(dialect, "import_dbapi", None) or dialect.dbapi)()
    except ImportError as error:
        module = (error.name or "").split(".")[0] or parsed.get_driver_name()
        raise ConfigError(f"{setting} {shown}: the {parsed.get_backend_name()} driver {module!r} is not "
                          f"installed: pip install {DRIVER_PACKAGES.get(module, module)}") from error
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        _check_folder(Path(parsed.database).expanduser(), f"{setting} {shown}")


def open_storage(url: str, setting: str = "storage") -> BaseStorage:
    """An Optuna RDB URL (`sqlite:///...`, `postgresql://...`) or a journal file path, checked by
    `check_storage` (`setting` names where the URL came from in its error)."""
    check_storage(url, setting)
    if "://" not in url:
        return JournalStorage(JournalFileBackend(url))
    if url.startswith("sqlite:///"):
        # Several processes write one SQLite file: wait for its lock instead of failing at once.
        return optuna.storages.get_storage(RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}}))
    return optuna.storages.get_storage(RDBStorage(url))


def make_pruner(spec: PrunerSpec) -> optuna.pruners.BasePruner:
    if spec.kind == PrunerKind.median:
        return optuna.pruners.MedianPruner(n_startup_trials=spec.n_startup_trials, n_warmup_steps=spec.n_warmup_steps)
    return optuna.pruners.NopPruner()


def open_study(spec: SweepSpec, storage: BaseStorage, create: bool = True) -> optuna.Study:
    kwargs = {"study_name": spec.name, "storage": storage, "pruner": make_pruner(spec.pruner),
              "sampler": optuna.samplers.TPESampler(seed=spec.seeds[0])}
    if not create:
        return optuna.load_study(**kwargs)
    study = optuna.create_study(direction="minimize", load_if_exists=True, **kwargs)
    if SWEEP_ATTR not in study.user_attrs:
        study.set_user_attr(SWEEP_ATTR, spec.describe())
    return study


def connect(spec: SweepSpec, url: str, attempts: int = 3, setting: str = "storage") -> optuna.Study:
    """Open the sweep's storage and study, creating them on first use. Workers that start together
    race to create the database schema and the study: the queue lock orders those sharing the
    output folder, and a race lost on a shared server is retried."""
    for attempt in range(attempts):
        try:
            with queue_lock(spec):
                return open_study(spec, open_storage(url, setting))
        except (SQLAlchemyError, StorageInternalError) as error:
            if attempt == attempts - 1:
                shown = make_url(url).render_as_string(hide_password=True) if "://" in url else url
                reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise ConfigError(f"{setting} {shown}: cannot open the database ({reason}): check the URL, "
                                  "that the server runs and that the user may create tables") from error
            time.sleep(1.0 + attempt)
    raise AssertionError("unreachable")


def _trial_id(study: optuna.Study, number: int) -> int:
    storage = study._storage  # noqa: SLF001 - the public Study API has no trial-id lookup
    return storage.get_trial_id_from_study_id_trial_number(study._study_id, number)  # noqa: SLF001


def _heartbeat_age(trial: FrozenTrial, now: float) -> float:
    last = trial.system_attrs.get(HEARTBEAT)
    if last is None:
        last = trial.datetime_start.timestamp() if trial.datetime_start else now
    return now - last


def fail_stale_trials(study: optuna.Study, stale_seconds: float) -> list[int]:
    """Fail RUNNING trials whose heartbeat is older than `stale_seconds`; return their numbers."""
    now, failed = time.time(), []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        age = _heartbeat_age(trial, now)
        if age <= stale_seconds:
            continue
        trial_id = _trial_id(study, trial.number)
        try:
            study._storage.set_trial_user_attr(trial_id, "failure", FailureKind.stale.value)  # noqa: SLF001
            study._storage.set_trial_user_attr(trial_id, "error", f"no heartbeat for {age:.0f} s")  # noqa: SLF001
            if study._storage.set_trial_state_values(trial_id, TrialState.FAIL):  # noqa: SLF001
                failed.append(trial.number)
        except UpdateFinishedTrialError:
            continue  # finished or failed meanwhile by its worker or another checker
    return failed


def settled_points(study: optuna.Study, retry_failed: bool = False) -> set[str]:
    """Points that must not be enqueued again: queued, running, done, or failed by their own error."""
    settled = set()
    for trial in study.get_trials(deepcopy=False):
        point = trial.user_attrs.get("point")
        if point is None:
            continue
        if trial.state != TrialState.FAIL or (not retry_failed and trial.user_attrs.get("failure") not in RETRYABLE):
            settled.add(point)
    return settled


@contextlib.contextmanager
def queue_lock(spec: SweepSpec) -> Iterator[None]:
    """Serialise enqueueing between workers that share the output folder (best effort: a server
    database shared by machines is guarded by the duplicate check at claim time instead)."""
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(spec.output_dir / f".{spec.name}.queue.lock")):
        yield


def sync_queue(study: optuna.Study, spec: SweepSpec, retry_failed: bool = False) -> int:
    """Fail stale trials, then enqueue every grid point not settled; return how many were enqueued."""
    with queue_lock(spec):
        fail_stale_trials(study, spec.stale_seconds)
        if not spec.is_grid:
            return 0
        settled = settled_points(study, retry_failed)
        missing = [p for p in spec.grid_points() if point_key(p) not in settled]
        for point in missing:
            study.enqueue_trial(point, user_attrs={"point": point_key(point)}, skip_if_exists=False)
        return len(missing)


def _duplicate_of(study: optuna.Study, trial: FrozenTrial) -> int | None:
    """The trial that owns this trial's point: a finished one, or a running one claimed earlier."""
    point = trial.user_attrs.get("point")
    for other in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                          TrialState.RUNNING)):
        if other.number != trial.number and other.user_attrs.get("point") == point:
            if other.state != TrialState.RUNNING or other.number < trial.number:
                return other.number
    return None


def claim_waiting(study: optuna.Study) -> optuna.Trial | None:
    """Atomically move one WAITING trial to RUNNING and return it; None when none is waiting."""
    storage = study._storage  # noqa: SLF001
    for waiting in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        trial_id = _trial_id(study, waiting.number)
        try:
            if not storage.set_trial_state_values(trial_id, TrialState.RUNNING):
                continue
        except UpdateFinishedTrialError:
            continue
        storage.set_trial_system_attr(trial_id, HEARTBEAT, time.time())
        owner = _duplicate_of(study, storage.get_trial(trial_id))
        if owner is not None:
            storage.set_trial_user_attr(trial_id, "failure", FailureKind.duplicate.value)
            storage.set_trial_user_attr(trial_id, "error", f"point already taken by trial {owner}")
            storage.set_trial_state_values(trial_id, TrialState.FAIL)
            continue
        return optuna.Trial(study, trial_id)
    return None


def state_counts(study: optuna.Study) -> dict[str, int]:
    """How many trials the study holds in each state, by state name."""
    counts: dict[str, int] = {}
    for trial in study.get_trials(deepcopy=False):
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    return counts


def running_trials(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


class Heartbeat:
    """Records `HEARTBEAT` on a RUNNING trial every `interval` seconds from a thread."""

    def __init__(self, study: optuna.Study, trial_id: int, interval: float):
        self.storage, self.trial_id, self.interval = study._storage, trial_id, interval  # noqa: SLF001
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.storage.set_trial_system_attr(self.trial_id, HEARTBEAT, time.time())
            except UpdateFinishedTrialError:
                return  # failed as stale by another worker: the runner notices at tell time

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
