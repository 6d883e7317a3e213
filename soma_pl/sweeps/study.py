"""The shared Optuna study of a sweep: storage, the grid queue, claiming trials, heartbeats.

Grid points are enqueued trials (`study.enqueue_trial`) carrying their point as the user attribute
`point`; their parameters are the factor labels, and their seed is the user attribute `seed` (a
repetition, so Optuna's samplers and importance analysis never see it). A worker claims a WAITING
trial by the storage's atomic WAITING → RUNNING transition, so two workers never claim the same trial;
a point enqueued twice (two workers starting at once on a server database) is run once: the later
claim is failed as `duplicate`. A point counts as done when it has a COMPLETE or PRUNED trial; one
failed by its own error stays failed (with its error) unless the runner is asked to retry failures.

A claimed trial's worker sends a heartbeat every `heartbeat_seconds`; a RUNNING trial without one for
`stale_seconds` (its worker was killed) is failed and its point run again:

- on a database (`sqlite:///...`, `postgresql://...`) by Optuna itself: `RDBStorage(heartbeat_interval,
  grace_period, heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback())` records the
  heartbeats, `optuna.storages.fail_stale_trials` fails stale trials, and the callback enqueues a
  copy (same point, system attribute `failed_trial` naming the original);
- on a journal file, where Optuna has no heartbeat, by this module: the heartbeat is the trial's
  system attribute `soma_pl:heartbeat`, a stale trial is failed with `failure: stale` and its point
  is enqueued again by `sync_queue`.

The storage object is passed explicitly (the one `open_storage` made), so nothing here reads a
study's private storage.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import optuna
from filelock import FileLock
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    check_distribution_compatibility,
)
from optuna.exceptions import ExperimentalWarning, StorageInternalError, UpdateFinishedTrialError
from optuna.storages import BaseStorage, JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, NoSuchModuleError, OperationalError, SQLAlchemyError

from soma_pl.errors import ConfigError
from soma_pl.io import write_json_atomic
from soma_pl.sweeps.space import SEED, PrunerKind, PrunerSpec, SweepSpec, point_key, point_params

HEARTBEAT = "soma_pl:heartbeat"
"""Trial system attribute (journal storage): the worker's wall-clock time at its last heartbeat."""
SWEEP_ATTR = "soma_pl:sweep"
"""Study user attribute: the sweep's description (factors, seeds, report layout)."""
STUDY_UID_ATTR = "soma_pl:uid"
"""Study user attribute: a random id set when the study is created, which the output folder's
`STUDY_MARKER` records, so that trial folders are written by one study only."""
STUDY_MARKER = ".soma_pl-study.json"
"""In a sweep's output folder: the study (name, storage, uid) whose trial folders it holds."""


class FailureKind(str, Enum):
    """Why a trial is FAIL (user attribute `failure`)."""

    error = "error"
    """The fit failed: kept with its error, not re-run (unless `--retry_failed`)."""
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


def _check_folder(file: Path, setting: str, create: bool) -> None:
    """A worker makes the folder of its storage file, as it makes the default one's (output_dir);
    a reader (`sweep report`) has nothing to read in a folder that does not exist."""
    if create:
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"{setting}: cannot make folder {file.parent} of {file.name}: "
                              f"{error.strerror or error}") from None
    if not file.parent.is_dir():
        raise ConfigError(f"{setting}: folder {file.parent} of {file.name} does not exist: name a file in an "
                          "existing folder")


def check_storage(url: str, setting: str = "storage", create_folder: bool = False) -> None:
    """Refuse a storage Optuna cannot open with one line naming `setting`: an unknown URL scheme, a
    database driver that is not installed, or a SQLite or journal file whose folder does not exist
    (`create_folder`: a worker's, made instead)."""
    if "://" not in url:
        _check_folder(Path(url).expanduser(), f"{setting} {url}", create_folder)
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
        _check_folder(Path(parsed.database).expanduser(), f"{setting} {shown}", create_folder)


CREATE_ATTEMPTS = 5
"""Openings of a database storage when another process is creating its tables at the same moment."""


def open_storage(url: str, setting: str = "storage", spec: SweepSpec | None = None) -> BaseStorage:
    """An Optuna RDB URL (`sqlite:///...`, `postgresql://...`) or a journal file path, checked by
    `check_storage` (`setting` names where the URL came from in its error). With the sweep's `spec`
    (a worker), a database storage runs Optuna's heartbeat: every `heartbeat_seconds`, stale after
    `stale_seconds` (whole seconds, at least 1), stale trials retried, and its storage file's folder
    is made."""
    check_storage(url, setting, create_folder=spec is not None)
    if "://" not in url:
        return JournalStorage(JournalFileBackend(url))
    kwargs = {}
    if url.startswith("sqlite:///"):
        # Several processes write one SQLite file: wait for its lock instead of failing at once.
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    if spec is not None:
        kwargs.update(heartbeat_interval=max(1, math.ceil(spec.heartbeat_seconds)),
                      grace_period=max(1, math.ceil(spec.stale_seconds)),
                      heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback())
    for attempt in range(CREATE_ATTEMPTS):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)  # the heartbeat arguments are marked experimental
                return optuna.storages.get_storage(RDBStorage(url, **kwargs))
        except (OperationalError, IntegrityError) as error:
            # Processes opening one new database at once (a sweep's workers, `reproduce` polling them)
            # race to create its tables and record its schema version; the one that loses finds them
            # made when it opens it again.
            racing = "already exists" in str(error) or "alembic_version" in str(error)
            if not racing or attempt == CREATE_ATTEMPTS - 1:
                raise
            time.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


def optuna_heartbeat(storage: BaseStorage) -> bool:
    """Whether Optuna records heartbeats and fails stale trials on this storage (a database opened
    for a worker); otherwise (a journal file) this module does."""
    return getattr(storage, "get_heartbeat_interval", lambda: None)() is not None


def make_pruner(spec: PrunerSpec) -> optuna.pruners.BasePruner:
    if spec.kind == PrunerKind.median:
        return optuna.pruners.MedianPruner(n_startup_trials=spec.n_startup_trials, n_warmup_steps=spec.n_warmup_steps)
    return optuna.pruners.NopPruner()


def distributions(spec: SweepSpec) -> dict[str, BaseDistribution]:
    """Each factor's and range's Optuna distribution. A grid sweep's numeric factors are numbers
    (integers or floats, on a log scale where `Factor.log`), so Optuna's dashboard and importance
    analysis see an axis; their values are still exactly the grid's, fixed when each point is
    enqueued. In a sweep with ranges TPE samples the grid factors, so there they are categorical."""
    found: dict[str, BaseDistribution] = {}
    for factor in spec.factors:
        if spec.is_grid and factor.numeric:
            kind = IntDistribution if isinstance(next(iter(factor.choices)), int) else FloatDistribution
            found[factor.name] = kind(min(factor.choices), max(factor.choices), log=factor.log)
        else:
            found[factor.name] = CategoricalDistribution(list(factor.choices))
    for range_ in spec.ranges:
        found[range_.name] = (IntDistribution(int(range_.low), int(range_.high), log=range_.log) if range_.integer
                              else FloatDistribution(range_.low, range_.high, log=range_.log))
    return found


def suggest(spec: SweepSpec, trial: optuna.Trial) -> dict:
    """The trial's factor labels and range values, each by its distribution (`distributions`). A grid
    trial's were fixed when its point was enqueued. The seed is never suggested: a grid trial's is
    its user attribute `seed`, and a range trial runs every seed."""
    params = {}
    for name, distribution in distributions(spec).items():
        if isinstance(distribution, CategoricalDistribution):
            params[name] = trial.suggest_categorical(name, distribution.choices)
        else:
            number = trial.suggest_int if isinstance(distribution, IntDistribution) else trial.suggest_float
            params[name] = number(name, distribution.low, distribution.high, log=distribution.log)
    return params


def check_distributions(spec: SweepSpec, study: optuna.Study) -> None:
    """Refuse a study whose trials gave a parameter a distribution this sweep file cannot share (a
    grid factor Optuna held as categories and the file now makes numeric, or other categories):
    Optuna would fail the first trial that suggests it."""
    expected = distributions(spec)
    for trial in study.get_trials(deepcopy=False):
        for name, distribution in trial.distributions.items():
            try:
                check_distribution_compatibility(distribution, expected.get(name, distribution))
            except ValueError:
                raise ConfigError(f"study {spec.name!r} holds trials whose parameter {name!r} is {distribution}, and "
                                  f"{spec.path} makes it {expected[name]}: finish that study with the sweep file "
                                  "it was started with, or start this sweep as a new study (another study name, "
                                  "storage or output_dir)") from None


def open_study(spec: SweepSpec, storage: BaseStorage, create: bool = True) -> optuna.Study:
    kwargs = {"study_name": spec.name, "storage": storage, "pruner": make_pruner(spec.pruner),
              "sampler": optuna.samplers.TPESampler(seed=spec.seeds[0])}
    if not create:
        return optuna.load_study(**kwargs)
    study = optuna.create_study(direction="minimize", load_if_exists=True, **kwargs)
    recorded = study.user_attrs.get(SWEEP_ATTR)
    if study.get_trials(deepcopy=False) and recorded is None:
        raise ConfigError(f"study {spec.name!r} holds trials but no record of the sweep and fit settings that ran them "
                          "(it was not started by `sweep`): start this sweep as a new study (another study name, "
                          "storage or output_dir)")
    check_distributions(spec, study)
    check_same_overrides(spec, study)
    if SWEEP_ATTR not in study.user_attrs or extends(study.user_attrs[SWEEP_ATTR], spec.describe()):
        study.set_user_attr(SWEEP_ATTR, spec.describe())
    if STUDY_UID_ATTR not in study.user_attrs:
        study.set_user_attr(STUDY_UID_ATTR, uuid.uuid4().hex)
    return study


def extends(recorded: dict, described: dict) -> bool:
    """Whether a sweep file now grows its study's grid: each factor keeps its values and may add some,
    all else unchanged. The study then records the larger grid, so `sweep report` reads the added
    values' trials beside the finished ones (a grid extended past a selection at its edge)."""
    recorded_labels, labels = recorded.get("labels", {}), described["labels"]
    grows = recorded_labels.keys() == labels.keys() and any(
        len(labels[name]) > len(recorded_labels[name]) for name in labels)
    kept = all(set(map(json.dumps, recorded_labels[name])) <= set(map(json.dumps, labels[name]))
               for name in recorded_labels.keys() & labels.keys())
    return grows and kept and all(recorded[key] == value for key, value in described.items()
                                  if key != "labels" and key in recorded)


def check_same_overrides(spec: SweepSpec, study: optuna.Study) -> None:
    """Refuse to add trials to a study with fit settings or a budget other than those its first
    worker ran with (the sweep file's `overrides` and `sweep --overrides`, and its `budget`, recorded
    with the study): its trials would differ in a setting that no parameter shows."""
    record, described = study.user_attrs.get(SWEEP_ATTR, {}), spec.describe()
    if record.get("budget") not in (None, described["budget"]):
        raise ConfigError(f"study {spec.name!r} was started with budget {record['budget']}; this sweep file has "
                          f"{described['budget']}: its trials would stop elsewhere; start this sweep as a new study "
                          "(another study name, storage or output_dir)")
    recorded = record.get("overrides")
    if recorded is None:
        return
    given = described["overrides"]
    if given != recorded:
        changed = sorted(key for key in {*recorded, *given} if recorded.get(key) != given.get(key))
        raise ConfigError(f"study {spec.name!r} was started with the fit settings {recorded} (the sweep file's "
                          f"overrides and --overrides); this worker has {given}, differing in {changed}: join it "
                          "with the same --overrides, or start this sweep as a new study (another study name, "
                          "storage or output_dir)")


def shown_storage(url: str) -> str:
    """The storage URL as errors show it: a database URL without its password."""
    return make_url(url).render_as_string(hide_password=True) if "://" in url else url


def claim_output(spec: SweepSpec, study: optuna.Study, url: str) -> None:
    """Record in the output folder which study writes its trial folders (`trial-NNNN`), or refuse a
    study that is not the one recorded: another storage, another study name, or a study created
    anew in a storage that was deleted would number its trials from 0 and overwrite the first
    one's `fit.log`, `trial_result.json` and checkpoints. Called under the queue lock."""
    marker = spec.output_dir / STUDY_MARKER
    uid = study.user_attrs[STUDY_UID_ATTR]
    if marker.is_file():
        try:
            owner = json.loads(marker.read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"{marker}: unreadable ({error}); it records which study owns the trial folders "
                              f"of {spec.output_dir}: restore it or give this sweep another output_dir") from error
        if owner.get("uid") != uid:
            raise ConfigError(
                f"output_dir {spec.output_dir} holds the trial folders of study {owner.get('study')!r} in storage "
                f"{owner.get('storage')}, not of study {spec.name!r} in {shown_storage(url)}: join that study "
                "with --storage, or give this sweep its own output_dir (trial folders are never shared)")
        return
    write_json_atomic(marker, {"study": spec.name, "storage": shown_storage(url), "uid": uid})


def connect(spec: SweepSpec, url: str, attempts: int = 3, setting: str = "storage") -> tuple[optuna.Study, BaseStorage]:
    """Open the sweep's storage (with heartbeats) and study, creating them on first use. Workers
    that start together race to create the database schema and the study: the queue lock orders
    those sharing the output folder, and a race lost on a shared server is retried."""
    for attempt in range(attempts):
        try:
            with queue_lock(spec):
                storage = open_storage(url, setting, spec)
                study = open_study(spec, storage)
                claim_output(spec, study, url)
                return study, storage
        except (SQLAlchemyError, StorageInternalError) as error:
            if attempt == attempts - 1:
                raise database_error(url, setting, error) from error
            time.sleep(1.0 + attempt)
    raise AssertionError("unreachable")


def database_error(url: str, setting: str, error: Exception) -> ConfigError:
    """One line for a storage that would not open (a file that is no database, a server that is down)."""
    shown = shown_storage(url)
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return ConfigError(f"{setting} {shown}: cannot open the database ({reason}): check the URL, that the server "
                       "runs and that the user may create tables")


def trial_id(storage: BaseStorage, study: optuna.Study, number: int) -> int:
    """The storage's id of trial `number` (the public Study API has no trial-id lookup)."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)


def beat(storage: BaseStorage, trial: int) -> None:
    """One heartbeat of the trial with storage id `trial`: Optuna's where it has them, else ours."""
    if optuna_heartbeat(storage):
        storage.record_heartbeat(trial)
    else:
        storage.set_trial_system_attr(trial, HEARTBEAT, time.time())


def _heartbeat_age(trial: FrozenTrial, now: float) -> float:
    last = trial.system_attrs.get(HEARTBEAT)
    if last is None:
        last = trial.datetime_start.timestamp() if trial.datetime_start else now
    return now - last


def fail_stale_trials(study: optuna.Study, storage: BaseStorage, stale_seconds: float) -> list[int]:
    """Fail RUNNING trials without a heartbeat for `stale_seconds`; return their numbers. On a
    database Optuna does it (and enqueues each one's retry); on a journal file this function."""
    if optuna_heartbeat(storage):
        before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        return sorted(t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
                      if t.number in before)
    now, failed = time.time(), []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        age = _heartbeat_age(trial, now)
        if age <= stale_seconds:
            continue
        identifier = trial_id(storage, study, trial.number)
        try:
            storage.set_trial_user_attr(identifier, "failure", FailureKind.stale.value)
            storage.set_trial_user_attr(identifier, "error", f"no heartbeat for {age:.0f} s")
            if storage.set_trial_state_values(identifier, TrialState.FAIL):
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


def selections(spec: SweepSpec, study: optuna.Study | None) -> dict[tuple, dict | None]:
    """A staged grid's first-stage selection of each group (`SweepSpec.stage_group`) whose first stage
    is over (every point complete, pruned or failed by its own error, and none queued or running
    again): the complete point of lowest value, or None when none completed (the group has no second
    stage). Empty for a grid of one stage."""
    if not spec.first or study is None:
        return {}
    first = {point_key(p): p for p in spec.grid_points()}
    settled, live = settled_points(study), set()  # over: settled, and not queued or running again
    complete: dict[str, list[float]] = {}
    for trial in study.get_trials(deepcopy=False):
        key = trial.user_attrs.get("point")
        if trial.state in (TrialState.WAITING, TrialState.RUNNING):
            live.add(key)
        elif trial.state == TrialState.COMPLETE and key in first:
            complete.setdefault(key, []).append(trial.value)

    groups: dict[tuple, list[str]] = {}
    for key, point in first.items():
        groups.setdefault(spec.stage_group(point), []).append(key)
    chosen: dict[tuple, dict | None] = {}
    for group, keys in groups.items():
        if all(key in settled and key not in live for key in keys):
            values = [(value, key) for key in keys for value in complete.get(key, ())]
            chosen[group] = first[min(values)[1]] if values else None
    return chosen


@contextlib.contextmanager
def queue_lock(spec: SweepSpec) -> Iterator[None]:
    """Serialise enqueueing between workers that share the output folder (best effort: a server
    database shared by machines is guarded by the duplicate check at claim time instead)."""
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(spec.output_dir / f".{spec.name}.queue.lock")):
        yield


def sync_queue(study: optuna.Study, storage: BaseStorage, spec: SweepSpec, retry_failed: bool = False) -> int:
    """Fail stale trials, then enqueue every grid point not settled; return how many were enqueued."""
    with queue_lock(spec):
        fail_stale_trials(study, storage, spec.stale_seconds)
        if not spec.is_grid:
            return 0
        settled = settled_points(study, retry_failed)
        missing = [p for p in spec.grid_points(selections(spec, study)) if point_key(p) not in settled]
        for point in missing:
            study.enqueue_trial(point_params(point), user_attrs={"point": point_key(point), SEED: point[SEED]},
                                skip_if_exists=False)
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


def claim_waiting(study: optuna.Study, storage: BaseStorage) -> optuna.Trial | None:
    """Atomically move one WAITING trial to RUNNING, send its first heartbeat and return it; None
    when none is waiting."""
    for waiting in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        identifier = trial_id(storage, study, waiting.number)
        try:
            if not storage.set_trial_state_values(identifier, TrialState.RUNNING):
                continue
        except UpdateFinishedTrialError:
            continue
        beat(storage, identifier)
        owner = _duplicate_of(study, storage.get_trial(identifier))
        if owner is not None:
            storage.set_trial_user_attr(identifier, "failure", FailureKind.duplicate.value)
            storage.set_trial_user_attr(identifier, "error", f"point already taken by trial {owner}")
            storage.set_trial_state_values(identifier, TrialState.FAIL)
            continue
        return optuna.Trial(study, identifier)
    return None


def state_counts(study: optuna.Study) -> dict[str, int]:
    """How many trials the study holds in each state, by state name."""
    counts: dict[str, int] = {}
    for trial in study.get_trials(deepcopy=False):
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    return counts


def best_value(study: optuna.Study) -> float | None:
    """The lowest value of the study's COMPLETE trials (None before the first)."""
    values = [t.value for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    return min(values) if values else None


def running_trials(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


class Heartbeat:
    """Sends a RUNNING trial's heartbeat (`beat`) every `interval` seconds from a thread."""

    def __init__(self, storage: BaseStorage, trial: int, interval: float):
        self.storage, self.trial, self.interval = storage, trial, interval
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                beat(self.storage, self.trial)
            except UpdateFinishedTrialError:
                return  # failed as stale by another worker: the runner notices at tell time

    def __enter__(self) -> Heartbeat:
        beat(self.storage, self.trial)  # a trial `study.ask` just made has none yet
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
