"""`--out` may not be, or lie inside, one of the command's inputs: the real CLI refuses it in one line
naming `--out` (exit 2) and the input is left byte for byte as it was. `runs` is tested in
tests/analysis/test_runs.py, on its real fits."""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest

from soma_pl import WINDOW_BYTES
from soma_pl.data.formats.evalsets import EvalSet
from soma_pl.lit import ZOModule
from soma_pl.sweeps.space import load_sweep
from soma_pl.sweeps.study import open_storage, open_study
from tests.analysis.conftest import random_router, save_checkpoint, tiny_experts
from tests.analysis.test_variance import TINY_CLI
from tests.robustness.cli import cli, one_error
from tests.sweeps.conftest import write_sweep
from tests.tiny_checkpoints import PROMPT, SHAPE, module_checkpoint


def contents(path: Path) -> dict[str, bytes]:
    """Every file at or under `path` with its bytes (what a refused command must leave as it was)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(file.relative_to(path.parent)): file.read_bytes() for file in files}


@pytest.fixture
def inputs(tmp_path) -> dict[str, Path]:
    """A checkpoint of each kind the commands read, a text file and folder, a prepared dataset and a sweep."""
    text = tmp_path / "texts" / "a.txt"
    text.parent.mkdir()
    text.write_bytes(PROMPT * (WINDOW_BYTES // len(PROMPT) + 2))
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    windows = np.random.default_rng(0).integers(0, 256, (2, WINDOW_BYTES), dtype=np.uint8)
    EvalSet(windows, np.array(["a", "b"]), np.array(["x"] * 2), np.zeros(2, dtype=np.int64)).save(
        prepared / "ensemble_val.npz")
    journal = tmp_path / "journal.log"
    sweep = write_sweep(tmp_path, storage=str(journal))
    open_study(load_sweep(sweep), open_storage(str(journal)))  # a study as `sweep` starts it, no trials yet
    return {"spsa": module_checkpoint(ZOModule(shape=SHAPE), tmp_path / "spsa.ckpt"),
            "experts": save_checkpoint(tmp_path / "experts.ckpt", tiny_experts(3), random_router(3)),
            "text": text, "prepared": prepared, "journal": journal, "sweep": sweep}


# Each case: the command's words with `{name}` for a path of `inputs`, the `--out` given, and the input it hits.
CASES = {
    "evaluate over its checkpoint": ("evaluate --checkpoint {spsa} --text {text} --resamples 10", "{spsa}", "spsa"),
    "evaluate over its text": ("evaluate --checkpoint {spsa} --text {text} --resamples 10", "{text}", "text"),
    "evaluate inside its text folder": ("evaluate --checkpoint {spsa} --text {text.parent} --resamples 10",
                                        "{text.parent}/result.json", "text"),
    "generate over its checkpoint": ("generate --checkpoint {spsa} --prompt abc --max_bytes 2", "{spsa}", "spsa"),
    "generate over its prompt file": ("generate --checkpoint {spsa} --prompt_file {text} --max_bytes 2", "{text}",
                                      "text"),
    "analyze topk over its checkpoint": ("analyze topk --checkpoint {experts} --data {prepared}", "{experts}",
                                         "experts"),
    "analyze topk over its dataset": ("analyze topk --checkpoint {experts} --data {prepared}",
                                      "{prepared}/ensemble_val.npz", "prepared"),
    "analyze error-correlation inside its dataset": ("analyze error-correlation --checkpoint {experts} "
                                                     "--data {prepared}", "{prepared}/result.json", "prepared"),
    "analyze variance over its checkpoint": (f"analyze variance {shlex.join(TINY_CLI)} --checkpoint {{experts}}",
                                             "{experts}", "experts"),
    "bench data inside its dataset": ("bench data --dataset.output_dir={prepared} --batches 1 --workers [0]",
                                      "{prepared}/bench.json", "prepared"),
    "sweep report over its sweep file": ("sweep report --sweep {sweep}", "{sweep}", "sweep"),
    "sweep report over its journal": ("sweep report --sweep {sweep}", "{journal}", "journal"),
}


@pytest.mark.parametrize("case", CASES)
def test_out_over_an_input_is_refused_and_the_input_kept(case, inputs, capsys):
    words, out, hit = CASES[case]
    kept = inputs[hit].parent if hit == "text" else inputs[hit]  # the text's folder: nothing may appear there
    before, out = contents(kept), out.format(**inputs)
    one_error(cli(capsys, *(word.format(**inputs) for word in shlex.split(words)), "--out", out), f"--out={out}")
    assert contents(kept) == before
