"""datatrove plumbing shared by `prepare` and `shard`: executors, corpus readers, task processes.

`prepare` and `shard` are datatrove pipelines. Each stage is a list of `PipelineStep`s run by an
executor chosen in the config (`ExecutorConfig.kind`): `local` (`LocalPipelineExecutor`: tasks x
workers on this machine, the default, all cores), `slurm` (`SlurmPipelineExecutor`: one job array per
stage, chained by dependencies) or `ray` (`RayPipelineExecutor`). A task reads its share of the
corpus files (datatrove deals them out: file i goes to task i mod tasks) and writes only files named
by its rank; datatrove writes a completion marker per finished task, so a killed run started again
skips the finished tasks and redoes the others. All of it happens in a staging folder beside the
output (`soma_pl.data.runner.staging`); the output appears only when the last stage renames the
finished folder into place.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import datatrove.executor.base as datatrove_executor_base
from datatrove.data import Document as PipelineDocument
from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.readers.base import BaseDiskReader

from soma_pl.data.corpus.documents import Document
from soma_pl.data.corpus.readers import CorpusConfig, CorpusKind, corpus_changed, corpus_files, iter_file
from soma_pl.data.runner.executor import ExecutorConfig, ExecutorKind, import_ray
from soma_pl.errors import ConfigError, SomaError
from soma_pl.locks import die_with_parent


def make_executor(config: ExecutorConfig, pipeline: list[PipelineStep], tasks: int, logging_dir: Path,
                  name: str, depends=None):
    """The configured datatrove executor for one stage (`depends`: the stage it waits for)."""
    kind = ExecutorKind(config.kind)
    workers = -1 if config.workers is None else min(config.workers, tasks)
    common = {"tasks": tasks, "workers": workers, "logging_dir": str(logging_dir), "depends": depends,
              **config.options}
    if kind is ExecutorKind.local:
        from datatrove.executor import LocalPipelineExecutor

        if workers == -1:
            common["workers"] = min(tasks, os.cpu_count() or 1)
        common.setdefault("start_method", default_start_method())
        if common["start_method"] == "forkserver":
            _preload_in_forkserver(pipeline)
        return LocalPipelineExecutor(pipeline, **common)
    if kind is ExecutorKind.slurm:
        from datatrove.executor import SlurmPipelineExecutor

        return SlurmPipelineExecutor(pipeline, job_name=f"soma_pl-{name}", **common)
    from datatrove.executor import RayPipelineExecutor

    return RayPipelineExecutor(pipeline, **common)


def default_start_method() -> str:
    """How local workers start when the config does not say: `fork` from a plain single-threaded
    process (the `prepare` command: workers start at once with everything imported), else
    `forkserver` (datatrove's default). A process holding other threads (a Lightning job, a
    notebook, W&B) or torch's thread pools can be forked while one of them holds a lock, and the
    worker then hangs on it; a worker forked from the fresh server process cannot. fsspec's IO
    thread, which datatrove starts, does not count: fsspec resets its loop and lock in a forked
    child (`os.register_at_fork`)."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" not in methods:
        return "spawn"
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.name != "fsspecIO"]
    if not others and "torch" not in sys.modules:
        return "fork"
    return "forkserver" if "forkserver" in methods else "fork"


def _preload_in_forkserver(pipeline: list[PipelineStep]) -> None:
    """Have the fork server import the modules of `pipeline`'s steps (torch among them, for
    `shard`) once, before it forks workers: each worker then starts with them imported instead of
    importing them again (about 2 s per worker for torch on a small machine)."""
    import multiprocess

    modules = sorted({type(step).__module__ for step in pipeline} | {__name__})
    multiprocess.get_context("forkserver").set_forkserver_preload(["__main__", *modules])  # `__main__`: the default


def chain(config: ExecutorConfig, pipelines: list[tuple[str, list[PipelineStep], int]], stage: Path,
          purpose: str) -> list[tuple[str, object]]:
    """One executor per `(name, steps, tasks)`, each depending on the one before: `(name, executor)`;
    logs and completion markers under `stage/logs/<name>`."""
    executors, previous = [], None
    for name, pipeline, count in pipelines:
        previous = make_executor(config, pipeline, count, stage / "logs" / name, f"{purpose}-{name}", previous)
        executors.append((name, previous))
    return executors


def run_stages(last) -> None:
    """Run a chain of stage executors: `last` launches the ones it depends on first. The processes
    they fork (datatrove's manager and pool workers) die with this one (`_die_with_parent`).

    Raises:
        SomaError: one line, before anything is submitted, when the cluster of a Slurm or Ray chain
            cannot take its work (`check_cluster`), or when `sbatch` fails while submitting.
    """
    global _CHILDREN_DIE_WITH_PARENT
    check_cluster(last)
    _console_logs()
    _CHILDREN_DIE_WITH_PARENT = True
    try:
        last.run()
    except subprocess.CalledProcessError as error:  # datatrove's `sbatch` call; its stderr went to the console
        raise SomaError(f"executor.kind=slurm: `{error.cmd[0]}` failed with exit status {error.returncode} while "
                        "submitting the stages' jobs (its message is above); jobs it submitted before stay "
                        "queued") from None
    finally:
        _CHILDREN_DIE_WITH_PARENT = False
        _console_logs()


SBATCH_SECONDS = 120
"""How long `sbatch --test-only` may take to answer (it retries a controller that does not answer)."""


def check_cluster(last) -> None:
    """Before a Slurm or Ray chain submits anything, one line when its cluster cannot take the work:
    for Slurm, `sbatch` missing from PATH, or failing a dry run of the first stage's job (`sbatch
    --test-only` with the job's own directives: the controller says whether it could schedule it,
    and nothing is queued); for Ray, `ray` not installed, or no running cluster to connect to
    (`RAY_ADDRESS`, else the one `ray start` left on this machine). A chain whose tasks are all
    done submits nothing and needs no cluster.

    Raises:
        ConfigError: naming what was tried and what it answered.
    """
    from datatrove.executor import RayPipelineExecutor, SlurmPipelineExecutor

    if not isinstance(last, SlurmPipelineExecutor | RayPipelineExecutor):
        return
    stages = _stages_of(last)
    if not any(stage.get_incomplete_ranks() for stage in stages):
        return
    if isinstance(last, SlurmPipelineExecutor):
        _check_sbatch(stages[0])
    else:
        _check_ray()


def _stages_of(last) -> list:
    """The executors of a chain, first stage first."""
    stages = [last]
    while stages[-1].depends is not None:
        stages.append(stages[-1].depends)
    return stages[::-1]


def _check_sbatch(first) -> None:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError("executor.kind=slurm: sbatch not found on PATH, so no job can be submitted: run the "
                          "command where SLURM's client is installed (a login node), or set executor.kind local")
    with tempfile.NamedTemporaryFile("w", suffix=".slurm") as script:
        script.write(first.get_launch_file_contents(first.get_sbatch_args(), "true"))
        script.flush()
        try:
            answer = subprocess.run([sbatch, "--test-only", script.name], capture_output=True, text=True,
                                    timeout=SBATCH_SECONDS)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"executor.kind=slurm: `sbatch --test-only` (a dry run of the first job) gave no "
                              f"answer in {SBATCH_SECONDS} s: is the SLURM controller up?") from None
    if answer.returncode != 0:
        said = next((line.strip() for line in (answer.stderr + answer.stdout).splitlines() if line.strip()),
                    "no message")
        raise ConfigError(f"executor.kind=slurm: `sbatch --test-only` (a dry run of the first job) failed with "
                          f"exit status {answer.returncode}: {said}")


def _check_ray() -> None:
    ray = import_ray()
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=address or "auto")  # "auto": a running cluster, never a new local one
    except (ConnectionError, RuntimeError, ValueError) as error:
        said = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        where = f"at RAY_ADDRESS={address}" if address else "on this machine"
        raise ConfigError(f"executor.kind=ray: no Ray cluster to connect to {where} (ray: {said}): start one "
                          "(`ray start --head`) or set RAY_ADDRESS, or set executor.kind local") from None


_CHILDREN_DIE_WITH_PARENT = False
"""True while this process runs stages: a child it forks then asks the kernel to kill it when
this process dies."""
_FORKED_BY = 0


def _note_parent() -> None:
    global _FORKED_BY
    _FORKED_BY = os.getpid()


def _die_with_parent() -> None:
    """In a child forked while stages run: SIGKILL when the parent dies (Linux `PR_SET_PDEATHSIG`).
    datatrove's manager process serves forever and its pool workers wait on a pipe the parent
    never closes, so without this a SIGKILL to the main process alone left them running."""
    request = die_with_parent(_FORKED_BY) if _CHILDREN_DIE_WITH_PARENT else None
    if request is not None:
        request()


os.register_at_fork(before=_note_parent, after_in_child=_die_with_parent)


LOG_FORMAT = ("{time:YYYY-MM-DD HH:mm:ss.SSS} | <level>{level: <8}</level> | {name}:{function}:{line} - "
              "<level>{message}</level>")
"""datatrove's format of a log line."""


_console_added = False
"""Whether this process's loguru holds soma_pl's console sink (a forked task inherits it; a task
started afresh, as under Slurm, adds it)."""
_task_sink: int | None = None
"""The loguru sink of the task this process runs."""


def _console_logs() -> None:
    """Only warnings, and no tracebacks, on the console (a failed task's error ends the command as
    one `soma_pl: error:` line; its traceback stays in the task's log file). The sink looks up
    `sys.stderr` at every message: one bound to the stream of the moment it was added would write
    to a closed stream once the host (pytest, a notebook, an in-process CLI) swapped it."""
    global _console_added
    from loguru import logger

    logger.remove()
    logger.add(lambda message: sys.stderr.write(message), level="WARNING", format=LOG_FORMAT,
               filter=lambda record: record["exception"] is None)
    _console_added = True


def _task_logger(logging_dir, rank: int, local_rank: int = 0, node_rank: int = -1):
    """datatrove's `add_task_logger` with soma_pl's console: the task's log file keeps everything.
    Sinks are added no more often than needed: loguru reads the interpreter's install paths at each
    (11 ms)."""
    global _task_sink
    from loguru import logger

    if not _console_added:
        _console_logs()
    logfile = logging_dir.open(f"logs/task_{rank:05d}.log", "w")
    prefix = f"[NODE {node_rank}] " if node_rank != -1 else ""
    _task_sink = logger.add(lambda message: _write_log(logfile, message), colorize=False, level="DEBUG",
                            format=prefix + LOG_FORMAT)
    logger.info(f"Launching pipeline for {rank=}")
    return logfile


def _write_log(logfile, message: str) -> None:
    """A line of the task's log file; one the disk refuses (full, read-only) is dropped: the write
    of the task's data fails on the same disk and ends the command with one line, which loguru's
    `Logging error` traceback for every log line would otherwise precede."""
    with contextlib.suppress(OSError):
        logfile.write(message)
        logfile.flush()


def _close_task_logger(logfile) -> None:
    from loguru import logger

    global _task_sink
    logger.complete()
    if _task_sink is not None:
        with contextlib.suppress(ValueError):  # gone already: the host removed every sink
            logger.remove(_task_sink)
        _task_sink = None
    with contextlib.suppress(OSError):  # what is left to flush onto a full disk is dropped (`_write_log`)
        logfile.close()


# datatrove sets up a task's logging with these two functions and offers no other hook; every
# process that runs a soma_pl step imports this module (the steps are defined here or in modules
# that import it: `preparation.steps`, `sharding.steps`), so local, forked, spawned and Slurm tasks
# all log the same way.
datatrove_executor_base.add_task_logger = _task_logger
datatrove_executor_base.close_task_logger = _close_task_logger


def to_pipeline(document: Document) -> PipelineDocument:
    """A soma_pl document as a datatrove one: `text` keeps the UTF-8 bytes (no decode/encode round
    trip; only soma_pl steps read it), provenance goes into `metadata`."""
    return PipelineDocument(text=document.text, id=document.doc_id,
                            metadata={"source": document.source, "title": document.title})


def from_pipeline(document: PipelineDocument) -> Document:
    return Document(document.text, document.metadata["source"], document.id, document.metadata.get("title", ""))


class CorpusFileReader(BaseDiskReader):
    """The corpus files of a task (datatrove deals them out), each read by soma_pl's reader of its kind
    (`soma_pl.data.corpus.readers`): the same documents, ids and one-line errors as a single-process read.
    Not datatrove's parquet reader: its dependency check reads the metadata of every installed
    distribution (0.26 s of each command)."""

    name = "soma_pl corpus"
    corpus: CorpusConfig

    def read_file(self, filepath: str) -> DocumentsPipeline:
        path = Path("/") / filepath
        if not path.exists():  # listed when prepare started
            raise corpus_changed(f"{path} disappeared")
        for document in iter_file(self.corpus, path):
            yield to_pipeline(document)


class DemoReader(PipelineStep):
    """The built-in demo corpus (one stream, not files): task r keeps documents r, r + tasks, ..."""

    name = "soma_pl demo"
    type = "📖 - READER"

    def __init__(self, corpus: CorpusConfig):
        super().__init__()
        self.corpus = corpus

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from soma_pl.data.corpus.demo import iter_demo_documents

        for number, document in enumerate(iter_demo_documents(tuple(self.corpus.demo_sources))):
            if number % world_size == rank:
                self.stat_update("documents")
                yield to_pipeline(document)


def corpus_reader(corpus: CorpusConfig, paths_file: Path, progress: bool = False) -> PipelineStep:
    """The reader step of a corpus; `paths_file` lists its files (written by `write_paths_file`);
    `progress` shows datatrove's per-task file progress bars."""
    kind = CorpusKind(corpus.kind)
    if kind is CorpusKind.demo:
        return DemoReader(corpus)
    reader = CorpusFileReader(data_folder="/", paths_file=str(paths_file), file_progress=progress)
    reader.corpus = corpus
    return reader


def write_paths_file(corpus: CorpusConfig, path: Path) -> None:
    """List the corpus files (absolute, sorted: the order tasks are dealt them) in `path`."""
    if CorpusKind(corpus.kind) is CorpusKind.demo:
        return
    files = [str(f.resolve()).lstrip("/") for f in corpus_files(CorpusKind(corpus.kind), corpus.paths)]
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text("\n".join(files) + "\n")
    os.replace(temporary, path)


def read_documents(data: DocumentsPipeline) -> Iterator[Document]:
    for document in data or ():
        yield from_pipeline(document)
