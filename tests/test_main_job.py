"""The main job (`python -m soma_pl.cli demo`) end to end at tiny settings: real prepare, shard, fits,
validations and tests in child processes, then the table JSON and the figure."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from soma_pl.cli import main
from soma_pl.main_job import DemoConfig, fit_length, thread_count
from tests.data.corpora import write_jsonl_corpus

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY_MODEL = ["--model.init_args.shape.width=8", "--model.init_args.shape.num_layers=1",
              "--model.init_args.shape.embed_dim=8",
              "--model.init_args.spsa.n_pert=2", "--model.init_args.spsa.micro_batch=2",
              "--model.init_args.train_context=16",
              "--data.init_args.batch_size=2", "--data.init_args.eval_batch_size=4",
              "--trainer.enable_model_summary=false"]


def _side(tmp_path: Path, name: str, data: Path, experts: int) -> dict:
    """A side's seed (2 updates) and sharding into `experts` in `tmp_path`."""
    folder = tmp_path / f"experts-n{experts}"
    return {"seed": ["--config", "configs/demo/seed.yaml", "--trainer.max_steps=2", "--trainer.val_check_interval=1"],
            "seed_dir": str(tmp_path / f"seed_{name}"),
            "shard": [f"--shard.prepared={data}", f"--shard.num_experts={experts}", f"--shard.output_dir={folder}",
                      "--shard.kmeans_n_init=1"],
            "overrides": [f"--data.init_args.experts_dir={folder}", "--data.init_args.expert_val_windows=4"]}


def _demo_config(tmp_path: Path) -> Path:
    corpus, data = tmp_path / "corpus", tmp_path / "data"
    write_jsonl_corpus(corpus, {"alpha": 30, "beta": 30}, min_words=150, max_words=500)
    demo = {
        "output_dir": str(tmp_path / "main_job"), "updates": 4, "val_every": 2,
        "prepare_args": ["--dataset.corpus.kind=jsonl", f"--dataset.corpus.paths=[{corpus}]",
                         f"--dataset.output_dir={data}", "--dataset.val_documents=2", "--dataset.val_windows=4",
                         "--dataset.test_windows=4", "--dataset.final_test_windows=4",
                         "--dataset.expert_val_fraction=0.05",
                         "--dataset.shard_max_bytes=40000"],
        "overrides": [f"--data.init_args.prepared={data}", "--data.init_args.recipe=null", *TINY_MODEL],
        "spsa": _side(tmp_path, "spsa", data, 1), "soma": _side(tmp_path, "soma", data, 2),
        "calibration": {"warmup": 1, "updates": 2},
    }
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump({"demo": demo}))
    return path


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One tiny main job, its progress bars on: its config, output folder, report, what it printed
    and what it showed on stderr."""
    tmp_path = tmp_path_factory.mktemp("demo")
    config = _demo_config(tmp_path)
    printed, shown = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed), contextlib.redirect_stderr(shown):
        patch.chdir(ROOT)  # the sides' configs are repository paths
        main(["demo", "--config", str(config)])
    out = tmp_path / "main_job"
    return config, out, json.loads((out / "main_job.json").read_text()), printed.getvalue(), shown.getvalue()


def _rerun(config: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    main(["demo", "--config", str(config), "--progress=false"])


def test_demo_writes_the_table_and_the_figure_and_reuses_finished_steps(demo_run, monkeypatch):
    config, out, report, printed, _ = demo_run
    spsa, soma = report["table"]["spsa"], report["table"]["soma"]
    assert (spsa["experts"], soma["experts"]) == (1, 2)
    assert spsa["updates"] == soma["updates"] == 4
    # Each side starts from its own seed (2 zero-order updates here): before its first update it
    # scores what the seed scored (SOMA: two copies, one mixture), and the seed's cost is its own.
    for name in ("spsa", "soma"):
        seed = report["seeds"][name]
        assert seed["updates"] == 2 and seed["aggregate_device_seconds"] > 0
        assert report["table"][name]["curve"][0]["val_loss"] == pytest.approx(seed["val_loss"], abs=1e-5)
    # (2 · n_pert + 1) · E · B · T token forwards per update: the ± evaluations, and the forward at the
    # weights themselves whose features and probabilities the delta-rule head learns from
    assert spsa["token_forwards"] == 4 * (2 * 2 + 1) * 1 * 2 * 16
    assert soma["token_forwards"] == 2 * spsa["token_forwards"]
    for name, side in (("spsa", spsa), ("soma", soma)):
        assert side["lr"] == getattr(DemoConfig(), name).lr  # the Table 6 selection's
        for stage in ("val", "test", "test_final"):
            low, high = side[stage]["bootstrap_95"]
            assert low <= side[stage]["loss"] <= high and 0 < side[stage]["loss"] < 6
        assert side["test_final"]["loss"] != side["test"]["loss"], "the final split is other windows"
        assert [p["step"] for p in side["curve"]] == [0, 2, 4]
        assert side["curve"][0]["token_forwards"] == 0 and side["curve"][-1]["token_forwards"] == side["token_forwards"]
        # The curve's update times are updates × the side's update time calibrated alone (2 updates
        # timed after 1), the one the report keeps; the fit's own measured time stands beside it.
        rate = report["calibration"]["seconds_per_update"][name]
        assert side["seconds_per_update"] == rate > 0 and side["aggregate_device_seconds"] > 0
        assert [p["device_seconds"] for p in side["curve"]] == pytest.approx([0.0, 2 * rate, 4 * rate])
    differences = report["difference_spsa_minus_soma"]
    assert differences["equal_arithmetic"]["test"] == pytest.approx(spsa["test"]["loss"] - soma["test"]["loss"])
    assert differences["equal_arithmetic"]["test_final"] == pytest.approx(
        spsa["test_final"]["loss"] - soma["test_final"]["loss"])

    # Equal measured update time: T is the faster side's total; the slower side is scored at its last
    # checkpoint within T, and its curve is interpolated at T.
    budget = min(spsa["curve"][-1]["device_seconds"], soma["curve"][-1]["device_seconds"])
    fast, slow = sorted((spsa, soma), key=lambda side: side["curve"][-1]["device_seconds"])
    assert fast["equal_time"]["budget_seconds"] == slow["equal_time"]["budget_seconds"] == budget
    assert fast["equal_time"]["updates"] == 4 and fast["equal_time"]["test"] == fast["test"]
    within = [p for p in slow["curve"] if p["device_seconds"] <= budget]
    assert slow["equal_time"]["updates"] == within[-1]["step"] and slow["equal_time"]["seconds"] <= budget
    if slow["equal_time"]["updates"] < 4:  # scored on its own: another checkpoint, other losses
        assert slow["equal_time"]["val"]["loss"] != slow["val"]["loss"]
    (a, b) = next((p, q) for p, q in zip(slow["curve"], slow["curve"][1:], strict=False)
                  if p["device_seconds"] <= budget <= q["device_seconds"])
    share = (budget - a["device_seconds"]) / (b["device_seconds"] - a["device_seconds"])
    expected = a["val_loss"] + share * (b["val_loss"] - a["val_loss"])
    assert slow["equal_time"]["val_interpolated"] == pytest.approx(expected)
    assert differences["equal_time"]["test"] == pytest.approx(
        spsa["equal_time"]["test"]["loss"] - soma["equal_time"]["test"]["loss"])
    assert report["load_during_fits"]["samples"] >= 1
    figure = Path(report["figure"]).read_bytes()
    assert figure.startswith(PNG_SIGNATURE) and len(figure) > 10_000
    assert "OMP_NUM_THREADS=1" in printed and f"figure: {out / 'main_job.png'}" in printed
    assert "| test loss [95%] |" in printed and "**equal update time** (Table 3's basis, calibrated)" in printed
    assert "SPSA − SOMA at equal update time (each side's calibrated alone)" in printed
    assert [path.parent.parent.name for path in sorted(out.glob("*/calibration-*/calibrate.json"))] == ["soma", "spsa"]

    # A second run reuses every recorded step: no fit runs again, the numbers are the same.
    fits = sorted(out.glob("*/run-*/fit/version_*"))
    _rerun(config, monkeypatch)
    assert sorted(out.glob("*/run-*/fit/version_*")) == fits
    again = json.loads((out / "main_job.json").read_text())
    assert again["table"] == report["table"]
    assert again["reused_steps"] == report["steps"] - 3  # all but prepare and the two shardings


def test_each_fit_shows_its_updates_and_latest_validation_loss(demo_run):
    """While a side's fit runs, a bar below the main one counts its updates and shows its latest
    ensemble-validation loss: at the end, the fit's last update of 4 and the loss of its summary."""
    _, _, report, _, shown = demo_run
    for side in ("spsa", "soma"):
        (path,) = (Path(report["table"][side]["run_dir"]) / "fit").glob("version_*/summary.json")
        summary = json.loads(path.read_text())
        assert summary["global_step"] == 4
        loss = f"{summary['metrics']['val/loss']:.4f}"
        assert re.search(rf"{side} fit: 100%[^\r\n]*\| 4/4 [^\r\n]*val loss {loss}\]", shown), (side, loss, shown)
    assert "main job steps: 100%" in shown


@pytest.mark.slow
def test_an_interrupted_fit_resumes_to_the_same_scores(demo_run, monkeypatch):
    # A fit stopped after update 2 (its record not written, its last checkpoint the one of update 2)
    # resumes from that checkpoint and reaches the uninterrupted run's weights and scores.
    config, out, report, *_ = demo_run
    (record,) = out.glob("spsa/run-*/fit.json")
    record.unlink()
    checkpoints = record.parent / "checkpoints"
    shutil.copyfile(checkpoints / "epoch=0-step=2.ckpt", checkpoints / "last.ckpt")
    _rerun(config, monkeypatch)
    assert json.loads(record.read_text())["resumed"]
    assert len(list(record.parent.glob("fit/version_*"))) == 1  # the resumed fit logs into its run's folder
    resumed = json.loads((out / "main_job.json").read_text())["table"]["spsa"]
    assert resumed["updates"] == 4 and resumed["test"] == report["table"]["spsa"]["test"]


def test_a_token_budget_replaces_the_step_count_and_keeps_the_cadence(tmp_path):
    demo = DemoConfig(output_dir=str(tmp_path), updates=4, val_every=2)
    by_steps, by_tokens = fit_length(demo), fit_length(replace(demo, token_forwards=512))
    assert by_steps[0] == "--trainer.max_steps=4"
    assert by_tokens[:2] == ["--budget.token_forwards=512", "--trainer.max_steps=1000000000"]
    assert by_steps[1:] == by_tokens[2:] == ["--trainer.val_check_interval=2", "--checkpoint.save_top_k=-1",
                                              "--trainer.log_every_n_steps=2"]


@pytest.mark.slow  # the whole main job again (about 100 s); the budget's arguments are checked above
def test_equal_token_forwards_gives_soma_half_the_updates(demo_run, monkeypatch):
    """`--demo.token_forwards` stops both sides at the same token forwards (a budget, not a step
    count): SOMA N = 2 forwards twice the tokens per update, so it makes half the updates."""
    config, out, report, *_ = demo_run
    budget = report["table"]["spsa"]["token_forwards"]  # SPSA's 4 updates
    monkeypatch.chdir(ROOT)
    main(["demo", "--config", str(config), "--progress=false", f"--demo.token_forwards={budget}"])
    equal = json.loads((out / "main_job.json").read_text())["table"]
    assert equal["spsa"]["token_forwards"] == equal["soma"]["token_forwards"] == budget
    assert (equal["spsa"]["updates"], equal["soma"]["updates"]) == (4, 2)
    assert equal["soma"]["curve"][-1]["multiply_adds"] == budget * (equal["soma"]["parameters"] // 2)


def test_a_finished_run_is_reused_only_on_the_data_it_was_trained_on(tmp_path):
    from soma_pl.main_job import DemoConfig, DemoSide, _data_fingerprints

    for folder, name, value in (("data", "manifest.json", "a" * 64), ("experts", "experts.json", "b" * 64)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text(json.dumps({"fingerprint": value}))
    side = DemoSide(config=[str(ROOT / "configs" / "datamodule" / "demo.yaml"),
                            str(ROOT / "configs" / "demo" / "soma_n2.yaml")],
                    overrides=[f"--data.init_args.experts_dir={tmp_path / 'experts'}"])
    demo = DemoConfig(overrides=[f"--data.init_args.prepared={tmp_path / 'data'}"])
    assert _data_fingerprints(demo, side) == ["a" * 64, "b" * 64]
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"fingerprint": "c" * 64}))
    assert _data_fingerprints(demo, side) == ["c" * 64, "b" * 64]


def test_threads_default_to_one_unless_set(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert thread_count(None) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert thread_count(None) == 2
    assert thread_count(3) == 3
