"""`python -m soma_pl.cli demo`: the paper's central claim at CPU scale, in one command.

Monolithic SPSA (one model) against SOMA (N experts of 1/N the size, each trained by SPSA on its own
semantic shard with its own loss), each from a seed of its own width trained by the paper's recipe
(`configs/demo/seed.yaml`: 1,000 zero-order updates, the head by the delta rule; its cost recorded
apart and excluded from both bases), both for the same number of updates at the same n_pert, B and
context (the equal-size pair `configs/demo/spsa.yaml` and `configs/demo/soma_n2.yaml`: 143,680 and
146,360 parameters, the same multiply-adds per update), on the same 1,024-byte sequences (the N = 1
and N = 2 shardings of one prepared dataset).
Each side runs the setting that the demo's Table 6 selection (`sweeps/demo/table7_pair.yaml`) chose
for it: its learning rate, and the selection's schedule (its number of updates, and a decay decided
every `plateau.every` updates however often the main job validates for its curves). Both sides train
on the context they are scored on (1,024 bytes). Every step is an ordinary `python -m soma_pl.cli`
command in a child process:

    prepare → per side: seed → shard → calibrate (alone, one side after the other)
    → per side: validate (the seed) → fit → validate → test → test (final split)
    → per side, at equal update time: validate → test → test (final split)

The two sides run side by side, one intra-op thread each unless `--demo.threads` or
`OMP_NUM_THREADS` says otherwise: on a CPU shared with other jobs, more threads per process mostly
spin in OpenMP waits. A finished step is reused when the command runs again with the same settings
(its record is `<step>.json`); an interrupted fit resumes from its last checkpoint. The children die
with the demo, and Ctrl-C stops them (`soma_pl.main_job_steps`). While a fit runs, a bar per side
counts its updates and shows its latest ensemble-validation loss (the fit's
`soma_pl.callbacks.progress.ProgressFile` writes them, the demo reads them). The command prints a
side-by-side table on both compute bases (`soma_pl.main_job_bases`): equal arithmetic (the same
updates of the equal-size pair) and equal update time (Table 3's U·Σₑ t̄ₑ: updates × each side's
update time calibrated alone before the fits, as the paper estimates its hours from recorded mean
step times, so the two sides running side by side do not slow each other's account; the measured
times and the load average they were measured under stand beside it), and writes `main_job.json`
(the same figures), `main_job.md` and `main_job.png` (ensemble-validation loss against updates,
multiply-adds and update time) into `--demo.output_dir`. The final test split
(`data.init_args.test_split=final`) is reported here and by the reproductions' final runs only.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from soma_pl.analysis.time_basis import CalibrationRun, equal_time_point, update_curve, versions
from soma_pl.config_files import config_args, override_args, read_layers
from soma_pl.data.formats.tar_shards import sha256_file
from soma_pl.errors import ConfigError, SomaError
from soma_pl.io import write_atomic, write_json_atomic
from soma_pl.main_job_bases import LoadSampler
from soma_pl.main_job_steps import Follow, Steps

SELECTION = "sweeps/demo/table7_pair.yaml"


@dataclass
class DemoSide:
    """One side of the comparison.

    Attributes:
        name: folder and key of this side in the outputs.
        label: its name in the table and the figure.
        config: its fit config: the method layer (which names its trainer base and data layer under
            `base:`), and any further layers, passed in order as repeated `--config`.
        lr: its learning rate (`model.optimizer.lr`): the Table 6 selection's.
        overrides: extra arguments for this side's fit, validate and test.
        seed: arguments of its seed's fit (config layers and overrides at the side's width).
        seed_dir: the seed's run folder; the side starts from `<seed_dir>/checkpoints/last.ckpt`.
        shard: arguments of its `shard` (its sequences, experts and router).
    """

    name: str = "spsa"
    label: str = "SPSA, N = 1"
    config: list[str] = field(default_factory=lambda: ["configs/demo/spsa.yaml"])
    lr: float = 0.000625
    overrides: list[str] = field(default_factory=list)
    seed: list[str] = field(default_factory=lambda: ["--config", "configs/demo/seed.yaml"])
    seed_dir: str = "runs/demo_seed_w64"
    shard: list[str] = field(default_factory=lambda: ["--config", "configs/shard/demo_n1.yaml"])


def _spsa() -> DemoSide:
    return DemoSide()


def _soma() -> DemoSide:
    return DemoSide(name="soma", label="SOMA, N = 2", config=["configs/demo/soma_n2.yaml"], lr=0.0025,
                    seed=["--config", "configs/demo/seed.yaml", "--model.shape.width=44"],
                    seed_dir="runs/demo_seed_w44", shard=["--config", "configs/shard/demo_n2.yaml"])


@dataclass
class DemoConfig:
    """The main job: what runs, for how long, and where its outputs go.

    Attributes:
        output_dir: every run, record, table and figure of the demo.
        updates: updates of each side; None: the selection's (`trainer.max_steps` of
            `sweeps/demo/table7_pair.yaml`), the length its learning rates were selected at. For the
            equal-size pair that is equal multiply-adds; SOMA then forwards N times the tokens, each
            through an expert of 1/N the size.
        token_forwards: give both sides this many token forwards instead (`--budget.token_forwards`;
            SOMA N = 2 then makes half the updates of SPSA, at half its multiply-adds).
        val_every: updates between the curves' ensemble-validation points (and checkpoints). The
            learning-rate decay does not follow it: the method configs decide a decay every
            `plateau.every` updates, as in the selection.
        threads: intra-op threads per child process. None: `OMP_NUM_THREADS` if set, else 1.
        parallel: run the two sides at the same time, in two processes.
        calibration: how each side's update time is measured alone before the fits (the time basis).
        prepare_args: arguments of `prepare` (a no-op when the dataset is up to date).
        spsa: the monolithic side.
        soma: the SOMA side.
        overrides: extra arguments for both sides' fit, validate and test.
    """

    output_dir: str = "runs/main_job"
    updates: int | None = None
    token_forwards: int | None = None
    val_every: int = 50
    threads: int | None = None
    parallel: bool = True
    calibration: CalibrationRun = field(default_factory=CalibrationRun)
    prepare_args: list[str] = field(default_factory=lambda: ["--config", "configs/data/demo.yaml"])
    spsa: DemoSide = field(default_factory=_spsa)
    soma: DemoSide = field(default_factory=_soma)
    overrides: list[str] = field(default_factory=list)


def thread_count(configured: int | None) -> int:
    """Intra-op threads for the children: the option, else `OMP_NUM_THREADS`, else 1."""
    if configured is not None:
        return configured
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def selected_updates(selection: str | Path = SELECTION) -> int:
    """The number of updates each trial of the selection ran (its `trainer.max_steps` override)."""
    import yaml

    overrides = (yaml.safe_load(Path(selection).read_text()) or {}).get("overrides") or {}
    if "trainer.max_steps" not in overrides:
        raise ConfigError(f"{selection} sets no trainer.max_steps: give --demo.updates")
    return int(overrides["trainer.max_steps"])


def updates_of(demo: DemoConfig) -> int:
    return selected_updates() if demo.updates is None else demo.updates


def _settings_key(args: list[str], data: list[str]) -> str:
    return hashlib.sha256(json.dumps([args, data]).encode()).hexdigest()[:8]


def _data_fingerprints(demo: DemoConfig, side: DemoSide) -> list[str]:
    """The fingerprints of the prepared dataset and expert shards the side's config reads: a run is
    reused only on the data it was trained on."""
    data = {}
    for _, settings in read_layers(config_args(side.config)):
        data.update((settings.get("data") or {}).get("init_args") or {})  # a later layer's keys win, as in the CLI
    for argument in [*demo.overrides, *side.overrides]:  # the last override of a folder wins
        key, _, value = argument.partition("=")
        if key.replace(".init_args.", ".") in ("--data.prepared", "--data.experts_dir"):
            data[key.rsplit(".", 1)[1]] = value
    found = []
    for folder, name in ((data.get("prepared"), "manifest.json"), (data.get("experts_dir"), "experts.json")):
        path = Path(folder) / name if folder else None
        if path is not None and path.is_file():
            found.append(json.loads(path.read_text()).get("fingerprint", ""))
    return found


def _side_args(demo: DemoConfig, side: DemoSide) -> list[str]:
    """Arguments shared by the side's fit, validate and test."""
    layers = config_args(side.config)
    return [*layers, f"--model.init_args.optimizer.init_args.lr={side.lr}",
            f"--model.init_args.seed_checkpoint={_seed_checkpoint(side)}",
            "--trainer.enable_progress_bar=false", "--wandb.group=main_job", *demo.overrides, *side.overrides]


def _seed_checkpoint(side: DemoSide) -> Path:
    return Path(side.seed_dir) / "checkpoints" / "last.ckpt"


def seed_side(demo: DemoConfig, side: DemoSide, steps: Steps, position: int = 1) -> dict:
    """The side's seed run (resumed if interrupted, reused when done with the same arguments): its
    cost, which neither basis counts (`updates`, `aggregate_device_seconds`, `wall_seconds`), and
    its ensemble-validation loss (`val_loss`)."""
    root = Path(side.seed_dir)
    args = ["fit", *side.seed, "--trainer.enable_progress_bar=false", "--wandb.group=main_job", *demo.overrides,
            f"--trainer.default_root_dir={root}", f"--checkpoint.dirpath={root / 'checkpoints'}"]
    resume = ["--ckpt_path=last"] if any((root / "checkpoints").glob("*.ckpt")) else []
    record = steps.run(Path(demo.output_dir), f"seed_{side.name}", args, resume=resume,
                       follow=Follow(f"{side.name} seed", None, position))
    summary = _fit_summary(root)
    compute = summary["compute"]
    return {"run_dir": str(root), "updates": compute["updates"], "val_loss": summary["metrics"]["val/loss"],
            "aggregate_device_seconds": round(compute["aggregate_device_hours"] * 3600, 3),
            "wall_seconds": record["seconds"]}


def calibrate_side(demo: DemoConfig, side: DemoSide, steps: Steps) -> float:
    """The side's update time measured alone (`demo.calibration`: a short fit of its settings, no
    validation), in seconds per update; reused when its settings and data are unchanged."""
    shared = _side_args(demo, side)
    folder = Path(demo.output_dir) / side.name / f"calibration-{_settings_key(shared, _data_fingerprints(demo, side))}"
    steps.run(folder, "calibrate", ["fit", *shared, *override_args(demo.calibration.overrides(folder / "fit"))])
    return demo.calibration.seconds_per_update(folder / "fit")


def fit_length(demo: DemoConfig) -> list[str]:
    """The fit's length and cadence: every validation keeps its checkpoint (the equal-time basis
    scores one) and has its update time logged (a logging interval dividing it)."""
    cadence = [f"--trainer.val_check_interval={demo.val_every}", "--checkpoint.save_top_k=-1",
               f"--trainer.log_every_n_steps={math.gcd(demo.val_every, 20)}"]
    if demo.token_forwards is None:
        return [f"--trainer.max_steps={updates_of(demo)}", *cadence]
    return [f"--budget.token_forwards={demo.token_forwards}", "--trainer.max_steps=1000000000", *cadence]


def _latest(folder: Path, name: str) -> Path:
    found = versions(folder, name)
    if not found:
        raise SomaError(f"no {name} under {folder}")
    return found[-1]


def _fit_summary(fit_root: Path) -> dict:
    """The latest `summary.json` that accounts for training (one resumed after its last update
    trains nothing and has no compute figures)."""
    for path in reversed(versions(fit_root, "summary.json")):
        summary = json.loads(path.read_text())
        if summary.get("compute"):
            return summary
    raise SomaError(f"no summary.json with compute figures under {fit_root}")


@dataclass
class SideResult:
    """What one side measured: the table's rows and the figure's curve."""

    label: str
    lr: float
    experts: int
    parameters: int
    updates: int
    token_forwards: int
    seconds_per_update: float
    """The update time calibrated alone: the time basis is updates × this."""
    aggregate_device_seconds: float
    """`U · Σₑ t̄ₑ` as measured during the fit (beside the other side): update time only."""
    fit_wall_seconds: float
    """The fit command's wall time, start-up and validations included (a reused fit: the time of
    the run that made it)."""
    val: dict
    """Ensemble-validation loss of the final weights: `loss`, `bootstrap_95`, `windows`, `documents`."""
    test: dict
    """Test loss of the final weights, as `val`."""
    test_final: dict
    """Loss of the final weights on the final test split (used once: the final runs only), as `val`."""
    curve: list[dict]
    """Ensemble-validation loss against compute: `step`, `token_forwards`, `multiply_adds`
    (token-forwards × parameters per expert), `device_seconds` (update time so far: updates × the
    calibrated time), `val_loss`."""
    run_dir: str
    equal_time: dict = field(default_factory=dict)
    """At the equal-time budget (`soma_pl.main_job_bases`): `TimePoint`'s fields, and `val`, `test`,
    `test_final` of the checkpoint at its `updates`."""


def _scores(path: Path) -> dict:
    scores = json.loads(path.read_text())
    return {key: scores[key] for key in ("loss", "bootstrap_95", "windows", "documents")}


def _score(folder: Path, shared: list[str], steps: Steps, checkpoint: str | None, tag: str = "") -> dict:
    """Ensemble validation, test and final test of `checkpoint` (None: the untrained start), each a
    CLI command; `tag` names the steps and folders of a checkpoint other than the last."""
    last = [] if checkpoint is None else ["--ckpt_path", checkpoint]
    runs = {"val": ("validate", []), "test": ("test", []),
            "test_final": ("test", ["--data.init_args.test_split=final"])}
    scores = {}
    for stage, (command, extra) in runs.items():
        name = f"{stage}{tag}"
        steps.run(folder, name, [command, *shared, *last, *extra, f"--trainer.default_root_dir={folder / name}"])
        scores[stage] = _scores(_latest(folder / name, f"{'val' if stage == 'val' else 'test'}_scores.json"))
    return scores


def fit_side(demo: DemoConfig, side: DemoSide, steps: Steps, seconds_per_update: float,
             position: int = 1) -> SideResult:
    """Untrained validation, fit (its update time the calibrated `seconds_per_update`), then the
    scores of the last checkpoint, as CLI commands; the fit's updates and latest validation loss
    show in a bar on line `position` below the main one."""
    shared = _side_args(demo, side)
    fit_args = [*shared, *fit_length(demo), f"--budget.seconds_per_update={seconds_per_update!r}"]
    seed = [sha256_file(_seed_checkpoint(side))] if _seed_checkpoint(side).is_file() else []
    folder = Path(demo.output_dir) / side.name / f"run-{_settings_key(fit_args, _data_fingerprints(demo, side) + seed)}"
    steps.run(folder, "init_validate", ["validate", *shared, f"--trainer.default_root_dir={folder / 'init'}"])
    checkpoints = folder / "checkpoints"
    fit = ["fit", *fit_args, f"--trainer.default_root_dir={folder / 'fit'}", f"--checkpoint.dirpath={checkpoints}"]
    # An interrupted fit resumes where it stopped (a fit refuses to start over on its checkpoints).
    resume = ["--ckpt_path=last"] if any(checkpoints.glob("*.ckpt")) else []
    follow = Follow(f"{side.name} fit", updates_of(demo) if demo.token_forwards is None else None, position)
    fit_record = steps.run(folder, "fit", fit, resume=resume, follow=follow)
    summary = _fit_summary(folder / "fit")
    scores = _score(folder, shared, steps, summary["last_checkpoint"])
    compute = summary["compute"]
    per_update = compute["token_forwards"] / max(compute["updates"], 1)
    points = [(0, _scores(_latest(folder / "init", "val_scores.json"))["loss"], 0.0), *update_curve(folder / "fit")]
    per_expert = summary["parameters"] // compute["experts"]
    curve = [{"step": s, "token_forwards": int(s * per_update), "multiply_adds": int(s * per_update) * per_expert,
              "device_seconds": seconds, "val_loss": v} for s, v, seconds in points]
    return SideResult(label=side.label, lr=side.lr, experts=compute["experts"], parameters=summary["parameters"],
                      updates=compute["updates"], token_forwards=compute["token_forwards"],
                      seconds_per_update=seconds_per_update,
                      aggregate_device_seconds=compute["aggregate_device_hours"] * 3600,
                      fit_wall_seconds=fit_record["seconds"], **scores, curve=curve, run_dir=str(folder))


def _each(steps: Steps, futures: dict) -> dict:
    """Each future's result by name; Ctrl-C stops the children first (the pool waits for its threads,
    and they for their children)."""
    try:
        return {name: future.result() for name, future in futures.items()}
    except KeyboardInterrupt:
        steps.stop()
        raise


def score_at_equal_time(demo: DemoConfig, side: DemoSide, result: SideResult, steps: Steps,
                        budget_seconds: float) -> None:
    """Fill `result.equal_time`: the side at `budget_seconds` of update time, its curve
    interpolated there and its checkpoint at the last validation within it scored in full."""
    point = equal_time_point(result.curve, budget_seconds)
    if point.updates == result.updates:
        scores = {stage: getattr(result, stage) for stage in ("val", "test", "test_final")}
    elif point.updates == 0:  # T falls before the first validation: the start is all that is within it
        scores = _score(Path(result.run_dir), _side_args(demo, side), steps, None, "_at_0")
    else:
        found = sorted(Path(result.run_dir, "checkpoints").glob(f"*step={point.updates}.ckpt"))
        if not found:
            raise SomaError(f"no checkpoint of update {point.updates} in {result.run_dir}/checkpoints")
        scores = _score(Path(result.run_dir), _side_args(demo, side), steps, str(found[-1]), f"_at_{point.updates}")
    result.equal_time = {**asdict(point), **scores}


def _interval(scores: dict) -> str:
    low, high = scores["bootstrap_95"]
    return f"{scores['loss']:.4f} [{low:.4f}, {high:.4f}]"


def table(results: dict[str, SideResult]) -> str:
    """The side-by-side table (markdown) on both compute bases, losses in nats/byte with 95%
    document-bootstrap intervals."""
    cells = {
        "parameters": lambda r: f"{r.parameters:,} ({r.experts} × {r.parameters // r.experts:,})",
        "learning rate (Table 6 selection)": lambda r: f"{r.lr:g}",
        "**equal arithmetic** (Table 11's basis): updates": lambda r: f"{r.updates:,}",
        "token-forwards": lambda r: f"{r.token_forwards:,}",
        "multiply-adds (token-forwards × parameters per expert)":
            lambda r: f"{r.token_forwards * r.parameters // r.experts:.3e}",
        "update time calibrated alone (s per update)": lambda r: f"{r.seconds_per_update:.4g}",
        "update time, U·Σₑ t̄ₑ (s): updates × calibrated (measured beside the other side)":
            lambda r: f"{r.updates * r.seconds_per_update:.0f} ({r.aggregate_device_seconds:.0f})",
        "fit wall time (s)": lambda r: f"{r.fit_wall_seconds:.0f}",
        "ensemble-validation loss [95%]": lambda r: _interval(r.val),
        "test loss [95%]": lambda r: _interval(r.test),
        "final test split loss [95%] (used once)": lambda r: _interval(r.test_final),
        "**equal update time** (Table 3's basis, calibrated): budget T (s)":
            lambda r: f"{r.equal_time['budget_seconds']:.0f}",
        "ensemble-validation loss at T (interpolated)": lambda r: f"{r.equal_time['val_interpolated']:.4f}",
        "checkpoint scored: updates (its update time, s)":
            lambda r: f"{r.equal_time['updates']:,} ({r.equal_time['seconds']:.0f})",
        "its ensemble-validation loss [95%]": lambda r: _interval(r.equal_time["val"]),
        "its test loss [95%]": lambda r: _interval(r.equal_time["test"]),
        "its final test split loss [95%]": lambda r: _interval(r.equal_time["test_final"]),
    }
    rows = [("", *[r.label for r in results.values()]),
            *[(name, *[cell(r) for r in results.values()]) for name, cell in cells.items()]]
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


def differences(spsa: SideResult, soma: SideResult) -> dict:
    """SPSA − SOMA (nats/byte; positive: SOMA lower) on each basis and evaluation set."""
    stages = ("val", "test", "test_final")
    timed = {"val_interpolated": spsa.equal_time["val_interpolated"] - soma.equal_time["val_interpolated"]}
    timed.update({stage: spsa.equal_time[stage]["loss"] - soma.equal_time[stage]["loss"] for stage in stages})
    return {"equal_arithmetic": {stage: getattr(spsa, stage)["loss"] - getattr(soma, stage)["loss"]
                                 for stage in stages}, "equal_time": timed}


def draw(results: dict[str, SideResult], path: Path) -> Path:
    """Both loss curves against updates, forward multiply-adds and update time; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_of = {"updates": ("step", 1, "updates"),
               "multiply-adds": ("multiply_adds", 1e12,
                                 "multiply-adds ≈ token-forwards × parameters per expert (10¹²)"),
               "update time": ("device_seconds", 60, "update time U·Σₑ t̄ₑ (minutes)")}
    figure, axes = plt.subplots(1, len(axes_of), figsize=(13, 3.8), sharey=True)
    for result in results.values():
        losses = [p["val_loss"] for p in result.curve]
        for axis, (key, scale, _) in zip(axes, axes_of.values(), strict=False):
            axis.plot([p[key] / scale for p in result.curve], losses, marker="o", ms=3, label=result.label)
    for axis, (_, _, label) in zip(axes, axes_of.values(), strict=False):
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    trained = [p["val_loss"] for r in results.values() for p in r.curve[1:]]
    if trained:  # the untrained start (about ln 256) would flatten the rest: it stays above the frame
        axes[0].set_ylim(min(trained) - 0.05, max(trained) + 0.05)
    axes[0].set_ylabel("ensemble-validation loss (nats/byte)")
    start = " and ".join(f"{r.curve[0]['val_loss']:.2f}" for r in results.values())
    figure.suptitle(f"Monolithic SPSA vs SOMA on the demo corpus, both from random weights (loss {start} at update 0)")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    write_atomic(buffer.getvalue(), path)
    return path


def _machine() -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cores": cores, "load_average": [round(x, 2) for x in os.getloadavg()]}


def _print_summary(report: dict, text: str, out: Path) -> None:
    arithmetic, timed = (report["difference_spsa_minus_soma"][basis] for basis in ("equal_arithmetic", "equal_time"))
    load = report["load_during_fits"]
    print(f"\n{text}\n\nSPSA − SOMA at equal arithmetic: {arithmetic['val']:+.4f} (ensemble validation), "
          f"{arithmetic['test']:+.4f} (test), {arithmetic['test_final']:+.4f} (final test) nats/byte\n"
          f"SPSA − SOMA at equal update time (each side's calibrated alone): {timed['val_interpolated']:+.4f} "
          f"(ensemble validation, interpolated), {timed['test']:+.4f} (test), {timed['test_final']:+.4f} (final "
          f"test) nats/byte; the fits' own update times were measured at load average "
          f"{load.get('mean', float('nan')):.2f} (mean of {load['samples']} samples, max "
          f"{load.get('max', float('nan')):.2f}) on {report['machine_start']['cores']} core(s)\n"
          f"wall time {report['wall_seconds']:.0f} s ({report['reused_steps']} of {report['steps']} steps reused "
          f"from an earlier run)\ntable: {out / 'main_job.json'}\nfigure: {out / 'main_job.png'}")


def main(demo: DemoConfig = DemoConfig(), progress: bool = True) -> dict:
    """The main job: monolithic SPSA against SOMA at equal compute, a table and a figure.

    Prepares, shards, times each side's update alone, runs both sides, scores both at equal update
    time, then prints and saves the table and the figure.

    Args:
        demo: what runs, for how long, and where (the `demo:` section of a YAML file).
        progress: show a progress bar.
    """
    if demo.threads is not None and demo.threads < 1:
        raise ConfigError(f"--demo.threads={demo.threads}: give the intra-op threads per child process (1 or more), "
                          "or leave it unset for OMP_NUM_THREADS (else 1)")
    sides = {side.name: side for side in (demo.spsa, demo.soma)}
    threads = thread_count(demo.threads)
    out = Path(demo.output_dir)
    machine = _machine()
    print(f"main job: {' vs '.join(s.label for s in sides.values())}; outputs in {out}/\n"
          f"threads: {threads} intra-op thread(s) per child process (OMP_NUM_THREADS={threads}; change with "
          f"--demo.threads or OMP_NUM_THREADS), {len(sides) if demo.parallel else 1} process(es) at a time on "
          f"{machine['cores']} core(s), load average {machine['load_average'][0]:.2f}", flush=True)
    started = time.monotonic()
    with tqdm(total=1 + 8 * len(sides), desc="main job steps", unit="step", disable=not progress) as bar:
        steps = Steps(threads, bar)
        # Always asked (each is a quick no-op when its output is up to date), so the two fits never
        # start on a missing dataset and race to build it.
        steps.run(out, "prepare", ["prepare", *demo.prepare_args, "--progress=false"], reuse=False)
        with ThreadPoolExecutor(len(sides) if demo.parallel else 1) as pool:
            seeds = _each(steps, {name: pool.submit(seed_side, demo, side, steps, line)
                                  for line, (name, side) in enumerate(sides.items(), start=1)})
        for side in sides.values():
            steps.run(out, f"shard_{side.name}", ["shard", *side.shard, "--progress=false"], reuse=False)
        calibrated = {name: calibrate_side(demo, side, steps) for name, side in sides.items()}  # one at a time
        with ThreadPoolExecutor(len(sides) if demo.parallel else 1) as pool, LoadSampler() as load:
            results = _each(steps, {name: pool.submit(fit_side, demo, side, steps, calibrated[name], line)
                                    for line, (name, side) in enumerate(sides.items(), start=1)})
        budget = min(result.curve[-1]["device_seconds"] for result in results.values())
        for name, result in results.items():
            if equal_time_point(result.curve, budget).updates != result.updates:
                bar.total += 3
            score_at_equal_time(demo, sides[name], result, steps, budget)
    report = {"table": {name: asdict(result) for name, result in results.items()},
              "difference_spsa_minus_soma": differences(results[demo.spsa.name], results[demo.soma.name]),
              "bases": {"equal_arithmetic": "the same updates of the equal-size pair (multiply-adds in the table)",
                        "equal_time": "T = the smaller total update time U·Σₑ t̄ₑ, updates × each side's update "
                                      "time calibrated alone; curves interpolated at T, each side's last checkpoint "
                                      "within T scored"},
              "calibration": {**asdict(demo.calibration), "seconds_per_update": calibrated},
              "seeds": seeds, "selection": SELECTION, "updates": updates_of(demo), "threads": threads,
              "machine_start": machine,
              "machine_end": _machine(), "load_during_fits": load.summary(),
              "wall_seconds": round(time.monotonic() - started, 1), "reused_steps": steps.reused,
              "steps": bar.total, "figure": str(out / "main_job.png")}
    text = table(results)
    draw(results, out / "main_job.png")
    write_atomic((text + "\n").encode(), out / "main_job.md")
    write_json_atomic(out / "main_job.json", report)
    _print_summary(report, text, out)
    return report
