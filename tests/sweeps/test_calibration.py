"""`sweep calibrate`: each configuration's update time measured alone, and every trial given it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from soma_pl.analysis.time_basis import CalibrationRun
from soma_pl.errors import ConfigError, SomaError
from soma_pl.sweeps import calibration, runner
from soma_pl.sweeps.calibration import (
    CALIBRATION,
    calibrate,
    calibration_key,
    calibration_points,
    check_calibrated,
    check_runs_calibrated,
)
from soma_pl.sweeps.space import load_sweep
from tests.data.corpora import write_jsonl_corpus

from .conftest import write_sweep


def test_the_calibrate_section_defaults_to_every_factor_and_refuses_naming_the_setting(tmp_path):
    assert load_sweep(write_sweep(tmp_path, calibrate={})).calibrate.by == ("N", "lr")
    spec = load_sweep(write_sweep(tmp_path, calibrate={"by": ["N"], "warmup": 1, "updates": 2}))
    assert (spec.calibrate.by, spec.calibrate.run) == (("N",), CalibrationRun(warmup=1, updates=2))
    assert load_sweep(write_sweep(tmp_path)).calibrate is None
    for section, named in (({"by": ["width"]}, "calibrate.by"), ({"updates": 0}, "calibrate.updates"),
                           ({"warmup": -1}, "calibrate.warmup"), ({"timed": 3}, "calibrate.timed")):
        with pytest.raises(ConfigError, match=named):
            load_sweep(write_sweep(tmp_path, calibrate=section))


def test_one_calibration_per_label_of_the_by_factors_the_others_held(tmp_path):
    spec = load_sweep(write_sweep(tmp_path, calibrate={"by": ["N"]}, first={"lr": 0.02}))
    points = calibration_points(spec)
    assert list(points.values()) == [{"N": 1, "lr": 0.02}, {"N": 2, "lr": 0.02}]
    # every trial of a label shares its calibration, whatever its lr
    assert calibration_key(spec, {"N": 2, "lr": 0.01, "seed": 1}) == calibration_key(spec, points['{"N": 2}'])


def test_seconds_per_update_is_the_logged_time_over_the_timed_updates(tmp_path):
    """Cumulative aggregate update time 0.5 s, then 2 s per update: after warm-up update 1, updates
    2..4 take 6 s, 2 s each."""
    metrics = tmp_path / "metrics.csv"
    rows = ["step,compute/aggregate_device_hours,train/loss", *(f"{step},{seconds / 3600},3.0" for step, seconds in
                                                                ((1, 0.5), (2, 2.5), (3, 4.5), (4, 6.5)))]
    metrics.write_text("\n".join(rows) + "\n")
    assert CalibrationRun(warmup=1, updates=3).seconds_per_update(tmp_path) == pytest.approx(2.0)
    assert CalibrationRun(warmup=0, updates=4).seconds_per_update(tmp_path) == pytest.approx(6.5 / 4)
    with pytest.raises(SomaError):
        CalibrationRun(warmup=1, updates=4).seconds_per_update(tmp_path)  # update 5 was never logged


def test_a_trial_runs_with_its_calibrated_time_and_without_one_is_refused(tmp_path):
    spec = load_sweep(write_sweep(tmp_path, calibrate={"by": ["N"]}))
    point = {"N": 2, "lr": 0.02, "seed": 0}
    with pytest.raises(ConfigError, match="calibrat"):
        runner.fit_command(spec, SimpleNamespace(number=0), point, 0, tmp_path / "t", "sqlite:///x.db", report=True)
    spec.output_dir.mkdir(parents=True)
    (spec.output_dir / CALIBRATION).write_text(json.dumps({"points": {
        calibration_key(spec, point): {"seconds_per_update": 0.25}}}))
    command = runner.fit_command(spec, SimpleNamespace(number=0), point, 0, tmp_path / "t", "sqlite:///x.db",
                                 report=True)
    assert "--budget.seconds_per_update=0.25" in command


def test_calibrate_times_a_real_fit_once_per_setting(tmp_path):
    """Two labels that differ only in their budget share one timing run."""
    corpus = tmp_path / "corpus"
    write_jsonl_corpus(corpus, {"alpha": 20, "beta": 20}, min_words=150, max_words=400)
    path = write_sweep(tmp_path, calibrate={"warmup": 1, "updates": 2}, report={},
                       grid={"run": {"choices": {"short": {"budget.token_forwards": 1000},
                                                 "long": {"budget.token_forwards": 2000}}}},
                       overrides={"data.init_args.dataset.corpus.paths": [str(corpus)],
                                  "data.init_args.dataset.output_dir": str(tmp_path / "data"),
                                  "trainer.logger": False})
    spec = load_sweep(path)
    saved = calibrate(spec, progress=False)
    short, long = saved['{"run": "short"}'], saved['{"run": "long"}']
    assert short["seconds_per_update"] == long["seconds_per_update"] > 0
    assert [entry.get("timed_as") for entry in (short, long)] in ([None, {"run": "short"}], [{"run": "long"}, None])
    assert short["updates"] == 2 and short["threads"] == 1
    on_disk = json.loads((spec.output_dir / CALIBRATION).read_text())
    assert on_disk["points"] == json.loads(json.dumps(saved))
    assert len(list(tmp_path.rglob("fit.log"))) == 0  # one timing run, its folder removed
    assert calibrate(spec, progress=False) == saved  # timed once: a second call runs nothing
    check_calibrated(spec)
    check_runs_calibrated(spec, [short["seconds_per_update"]] * 2)
    with pytest.raises(ConfigError, match=str(spec.output_dir)):  # a run timed by another calibration
        check_runs_calibrated(spec, [short["seconds_per_update"], None])


def test_a_worker_refuses_a_sweep_not_yet_calibrated_before_claiming_a_trial(tmp_path):
    path = write_sweep(tmp_path, calibrate={"by": ["N"]})
    with pytest.raises(ConfigError, match="sweep calibrate"):
        runner.main(str(path), storage=f"sqlite:///{tmp_path / 'x.db'}")
    assert not (tmp_path / "x.db").exists()  # refused before any study


def test_a_sweep_reuses_the_calibration_of_another_sweep_that_timed_the_same_arithmetic(tmp_path, monkeypatch):
    """The main job's case: its sides are the selection's trials at one lr each. The selection's lr is a
    factor outside `by` (free of arithmetic), so each side takes the selection's time; a side whose
    arithmetic differs (another width) and a source timed with other updates are measured anew."""
    for folder in ("selection", "job", "wider", "longer", "bad"):
        (tmp_path / folder).mkdir()
    source = load_sweep(write_sweep(tmp_path / "selection", calibrate={"by": ["N"]}))
    source.output_dir.mkdir(parents=True)
    times = {'{"N": 1}': 0.681, '{"N": 2}': 0.7996}
    points = {key: {"params": params, "seconds_per_update": times[key]}
              for key, params in calibration_points(source).items()}
    (source.output_dir / CALIBRATION).write_text(json.dumps({"points": points}))
    measured = []
    monkeypatch.setattr(calibration, "measure", lambda spec, params: measured.append(params) or
                        {"params": params, "seconds_per_update": 9.0})

    def job(folder, two, **section):
        grid = {"N": {"choices": {1: {"model.init_args.optimizer.init_args.lr": 0.005}, 2: two}}}
        return load_sweep(write_sweep(tmp_path / folder, grid=grid, calibrate={"by": ["N"], **section}))

    same = {"model.init_args.num_experts": 2, "model.init_args.optimizer.init_args.lr": 0.01}
    saved = calibrate(job("job", same, reuse=str(source.path)), progress=False)
    assert {key: entry["seconds_per_update"] for key, entry in saved.items()} == times and measured == []
    assert {entry["reused_from"] for entry in saved.values()} == {str(source.path)}
    wider = {**same, "model.init_args.shape.width": 12}
    saved = calibrate(job("wider", wider, reuse=str(source.path)), progress=False)
    assert [saved[key]["seconds_per_update"] for key in times] == [0.681, 9.0] and measured == [{"N": 2}]
    saved = calibrate(job("longer", same, reuse=str(source.path), updates=20), progress=False)
    assert [entry["seconds_per_update"] for entry in saved.values()] == [9.0, 9.0]
    with pytest.raises(ConfigError, match="calibrate.reuse"):
        job("bad", same, reuse=3)
