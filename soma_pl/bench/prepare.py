"""`bench prepare`: `prepare` throughput (MB/s of document text) and peak memory per task, at 1 and
N tasks, on a corpus in the FineWeb-Edu parquet schema: generated, or real text (`--corpus stdlib`:
this interpreter's standard-library sources, present on every machine).

Each measurement runs the whole command (`python -m soma_pl.cli prepare`) in a fresh process and
times it from start to exit. Peak RSS is reported per task, as each task's process recorded it
(`manifest.json: peak_rss_mib`). The corpus has the columns of FineWeb-Edu (`text`, `id`, `dump`,
`url`, `file_path`, `language`, `language_score`, `token_count`, `score`, `int_score`); its text is
words drawn from a fixed vocabulary, and a small share of documents repeat a passage of another, so
the overlap screen has something to exclude. Real text repeats itself far more (licence headers,
imports, docstring boilerplate), which is what the overlap screen's confirmation of each hit meets.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm import tqdm

from soma_pl.errors import ConfigError
from soma_pl.io import check_apart, emit_json


def write_fineweb_corpus(folder: Path, total_bytes: int, files: int, seed: int = 0) -> dict:
    """Write `files` parquet files holding about `total_bytes` of text; return what was written."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "pe", "da", "gi", "zu", "ber", "tan", "el", "or"]
    vocabulary = np.array(sorted({"".join(rng.choice(syllables, rng.integers(1, 5))) for _ in range(20_000)}))
    folder.mkdir(parents=True, exist_ok=True)
    per_file, written, documents, texts = total_bytes // files, 0, 0, []
    for index in range(files):
        rows, size = [], 0
        while size < per_file:
            words = vocabulary[rng.integers(0, len(vocabulary), int(rng.lognormal(6.6, 0.7)) + 20)]
            text = " ".join(words.tolist()) + "."
            if texts and rng.random() < 0.02:  # a passage of an earlier document, as web text repeats
                earlier = texts[int(rng.integers(len(texts)))]
                text = text[: len(text) // 2] + earlier[: 400] + text[len(text) // 2 :]
            texts = (texts + [text])[-200:]
            rows.append(text)
            size += len(text)
        ids = [f"<urn:uuid:{documents + i:012d}>" for i in range(len(rows))]
        table = _fineweb_table(rows, ids, [f"https://example.org/{documents + i}" for i in range(len(rows))],
                               f"s3://commoncrawl/{index:05d}.warc.gz", rng)
        pq.write_table(table, folder / f"{index:03d}_00000.parquet")
        written += size
        documents += len(rows)
    return {"files": files, "documents": documents, "text_bytes": written,
            "parquet_bytes": sum(f.stat().st_size for f in folder.glob("*.parquet"))}


def _fineweb_table(rows: list[str], ids: list[str], urls: list[str], file_path: str, rng: np.random.Generator):
    import pyarrow as pa

    return pa.table({
        "text": rows, "id": ids, "dump": ["CC-MAIN-2024-10"] * len(rows), "url": urls,
        "file_path": [file_path] * len(rows), "language": ["en"] * len(rows),
        "language_score": rng.uniform(0.65, 1.0, len(rows)), "token_count": [len(t) // 4 for t in rows],
        "score": rng.uniform(2.5, 5.0, len(rows)), "int_score": rng.integers(3, 6, len(rows)),
    })


def source_documents(root: Path, document_bytes: int) -> list[tuple[str, str]]:
    """`(id, text)` of the `*.py` files under `root` (sorted), each cut at blank lines into documents
    of about `document_bytes`: paragraphs are joined until they reach it; a file's tail under half of
    it joins its last document, and a file shorter than it is one document."""
    documents = []
    for path in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()):
        name = path.relative_to(root).as_posix()
        pieces, current = [], ""
        for paragraph in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
            current = f"{current}\n\n{paragraph}" if current else paragraph
            if len(current.encode()) >= document_bytes:
                pieces.append(current)
                current = ""
        if current:
            if pieces and len(current.encode()) < document_bytes // 2:
                pieces[-1] = f"{pieces[-1]}\n\n{current}"
            else:
                pieces.append(current)
        documents += [(f"<stdlib:{name}#{k}>", text) for k, text in enumerate(pieces)]
    return documents


def write_source_corpus(folder: Path, files: int, root: Path | None = None, document_bytes: int = 2000,
                        seed: int = 0) -> dict:
    """This interpreter's standard-library sources (`root`: another folder of `*.py`) as documents in
    the FineWeb-Edu schema, dealt over `files` parquet files in order; return what was written."""
    import sysconfig

    import pyarrow.parquet as pq

    root = Path(root or sysconfig.get_paths()["stdlib"])
    documents = source_documents(root, document_bytes)
    if not documents:
        raise ConfigError(f"bench prepare --corpus stdlib: no *.py files under {root}")
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(documents) // files)
    for index in range(files):
        part = documents[index * per_file : (index + 1) * per_file]
        ids, rows = [d for d, _ in part], [t for _, t in part]
        table = _fineweb_table(rows, ids, [f"file://{root.as_posix()}/{d.split(':', 1)[1].split('#')[0]}"
                                           for d in ids], f"stdlib/{index:05d}", rng)
        pq.write_table(table, folder / f"{index:03d}_00000.parquet")
    return {"files": files, "documents": len(documents), "source": str(root),
            "text_bytes": sum(len(t.encode()) for _, t in documents),
            "parquet_bytes": sum(f.stat().st_size for f in folder.glob("*.parquet"))}


def scratch_folder(workdir: str | None, bench: str) -> tempfile.TemporaryDirectory:
    """A scratch folder under `workdir` (made if missing), or the system's temporary folder."""
    if workdir is not None:
        try:
            Path(workdir).expanduser().mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"{bench}: --workdir {workdir}: {error.strerror or error}") from None
    return tempfile.TemporaryDirectory(dir=None if workdir is None else Path(workdir).expanduser())


ROOT = Path(__file__).resolve().parents[2]
"""The project root (its `configs/`)."""


def timed(command: list[str], failure: str) -> float:
    """Run `command` to its end; its wall seconds. A failure ends the bench with `failure` and the
    command's last line of error output."""
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or ["(no output)"]
        raise SystemExit(f"{failure}: {lines[-1]}")
    return round(seconds, 3)


def run_prepare(corpus: Path, output: Path, tasks: int, extra: tuple[str, ...] = (),
                bench: str = "bench prepare") -> dict:
    """One whole `prepare` command at `tasks` tasks (`extra`: further arguments): wall seconds and
    the manifest's figures (`bench` names the bench in a failure's line)."""
    command = [sys.executable, "-m", "soma_pl.cli", "prepare", "--progress", "false",
               "--config", str(ROOT / "configs" / "data" / "fineweb_edu.yaml"),
               f"--dataset.corpus.paths=[{corpus}]", f"--dataset.output_dir={output}",
               f"--dataset.executor.tasks={tasks}", *extra]
    seconds = timed(command, f"{bench}: prepare failed at {tasks} tasks")
    manifest = json.loads((output / "manifest.json").read_text())
    return {"tasks": tasks, "seconds": seconds, "in_process_seconds": manifest["prepare_seconds"],
            "peak_rss_mib_per_task": manifest["peak_rss_mib"], "task_seconds": manifest["task_seconds"],
            "parallel_stage_seconds": round(max(manifest["task_seconds"]["select"])
                                            + max(manifest["task_seconds"]["write"]), 3),
            "train_documents": manifest["train"]["documents"],
            "test_excluded": manifest["test"]["excluded"], "shards": len(manifest["train"]["shards"])}


def time_task_counts(tasks: tuple[int, ...], rounds: int, measure: Callable[[int, int], dict], text_bytes: int,
                     desc: str, progress: bool = True) -> dict:
    """Time `measure(count, round)` (one whole command at `count` tasks, returning its `seconds` and
    `parallel_stage_seconds`) `rounds` times per task count, the counts taking turns (1, 2, 1, 2,
    ...) so that a change of load on the machine touches both.

    Returns:
        `runs` (per task count, the round of median time with `mb_per_second` of `text_bytes`,
        `seconds_per_round` and `median_parallel_stage_seconds`), the whole command's speed-up over
        1 task and that of its parallel stages alone, both from medians, and the load average
        before and after.
    """
    load_before = os.getloadavg()
    measured: dict[int, list[dict]] = {count: [] for count in tasks}
    with tqdm(total=rounds * len(tasks), desc=desc, unit="run", disable=not progress) as bar:
        for round_ in range(rounds):
            for count in tasks:
                run = measure(count, round_)
                run["mb_per_second"] = round(text_bytes / 1e6 / run["seconds"], 3)
                measured[count].append(run)
                bar.update()
    runs = []
    for results in measured.values():
        median = sorted(results, key=lambda r: r["seconds"])[len(results) // 2]
        runs.append({**median, "seconds_per_round": [r["seconds"] for r in results],
                     "median_parallel_stage_seconds": float(np.median([r["parallel_stage_seconds"] for r in results]))})
    base = next((r for r in runs if r["tasks"] == 1), None)
    speedup = {str(r["tasks"]): round(base["seconds"] / r["seconds"], 2) for r in runs} if base else {}
    stages = ({str(r["tasks"]): round(base["median_parallel_stage_seconds"] / r["median_parallel_stage_seconds"], 2)
               for r in runs} if base else {})
    return {"runs": runs, "speedup_over_1_task": speedup, "parallel_stages_speedup_over_1_task": stages,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "cpu_count": os.cpu_count(), "python": platform.python_version()}


def bench_prepare(megabytes: float = 100.0, files: int = 8, tasks: tuple[int, ...] = (1, 2),
                  workdir: str | None = None, extra: tuple[str, ...] = (), rounds: int = 3,
                  progress: bool = True, corpus: Literal["generated", "stdlib"] = "generated",
                  source: str | None = None) -> dict:
    """Generate the corpus, then time `prepare` at each task count (`time_task_counts`), a fresh
    output folder each time.

    Returns:
        `corpus` (files, documents, text and parquet bytes) and `time_task_counts`'s figures: per
        task count seconds, MB/s of text, peak RSS per task in MiB, each task's own seconds per
        stage, ...; the parallel stages are the slowest select task plus the slowest write task
        (start-up, the planning task and the merge run once whatever the task count).
    """
    kind = corpus
    with scratch_folder(workdir, "bench prepare") as scratch:
        root = Path(scratch)
        corpus = write_source_corpus(root / "corpus", files, Path(source) if source else None) \
            if kind == "stdlib" else write_fineweb_corpus(root / "corpus", int(megabytes * 1e6), files)

        def measure(count: int, round_: int) -> dict:
            output = root / f"prepared-{count}-{round_}"
            run = run_prepare(root / "corpus", output, count, extra)
            shutil.rmtree(output)
            return run

        timing = time_task_counts(tasks, rounds, measure, corpus["text_bytes"], "bench prepare", progress)
    return {"bench": "prepare", "corpus": {"kind": kind, **corpus}, "rounds": rounds, **timing}


def main(megabytes: float = 100.0, files: int = 8, tasks: tuple[int, ...] = (1, 2), workdir: str | None = None,
         prepare_args: tuple[str, ...] = (), rounds: int = 3, progress: bool = True,
         out: str = "bench_prepare.json", corpus: Literal["generated", "stdlib"] = "generated",
         source: str | None = None) -> None:
    """`prepare` throughput and peak memory per task at 1 and N tasks, on a generated or a real-text corpus.

    Args:
        megabytes: text in the generated corpus (MB), in the FineWeb-Edu parquet schema.
        files: parquet files (datatrove deals files to tasks).
        tasks: task counts to time.
        workdir: where the scratch corpus goes; None: the system's temporary folder.
        prepare_args: further `prepare` arguments, e.g. `[--dataset.test_windows=64]` for a small corpus.
        rounds: times each task count runs, taking turns.
        progress: show a progress bar.
        out: where to write the JSON.
        corpus: `generated` (words from a fixed vocabulary, `megabytes` of them) or `stdlib` (this
            interpreter's standard-library `*.py` sources, about 31 MB on CPython 3.11, cut at blank lines into
            documents of about 2,000 bytes, short files and tails shorter; `megabytes` is ignored).
        source: with `stdlib`, another folder of `*.py` sources to read instead.
    """
    if megabytes <= 0 or files < 1 or not tasks or min(tasks) < 1 or rounds < 1:
        raise ConfigError("bench prepare: --megabytes must be > 0, --files, --rounds and every --tasks >= 1")
    check_apart(out, "--out", [source])
    emit_json(bench_prepare(megabytes, files, tuple(tasks), workdir, tuple(prepare_args), rounds, progress, corpus,
                            source), out)
