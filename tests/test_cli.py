"""The entry point: its command table, `--help` at every level, bad input, and a `fit` run."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from soma_pl.cli import COMMANDS, command_parser, main
from tests.data.corpora import write_jsonl_corpus

ROOT = Path(__file__).resolve().parents[1]
LIGHTNING = ("fit", "validate", "test", "predict")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "soma_pl.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_help_lists_every_command_with_its_description():
    result = run("--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name, command in COMMANDS.items():
        assert any(line.strip().startswith(f"{name} ") and line.endswith(f" {command.description}")
                   for line in lines), name
    assert set(LIGHTNING) <= set(COMMANDS) and all(COMMANDS[name].module is None for name in LIGHTNING)


def test_no_command_lists_them_on_stderr_and_exits_2():
    result = run()
    assert result.returncode == 2 and result.stdout == ""
    assert all(command.description in result.stderr for command in COMMANDS.values())


def test_a_group_lists_its_subcommands():
    result = run("bench", "--help")
    assert result.returncode == 0, result.stderr
    bench = [name for name in COMMANDS if name.startswith("bench ")]
    assert len(bench) == 7 and all(f"{name}  " in result.stdout for name in bench)
    assert "analyze" not in result.stdout
    assert run("bench").returncode == 2


@pytest.mark.parametrize("name", [name for name, command in COMMANDS.items() if command.module is not None])
def test_each_description_is_the_first_line_of_its_function_docstring(name):
    command = COMMANDS[name]
    assert inspect.getdoc(command.load()).splitlines()[0] == command.description
    assert command_parser(name).description == command.description  # the signature makes a parser


def test_a_subcommand_help_shows_each_option_docstring():
    result = run("bench", "zo", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "experts of the SOMA record; 0 skips it." in text  # a parameter's `Args:` entry
    assert "--n_pert N_PERT Directions per update." in text  # a field of the flattened settings


def test_sweep_help_names_its_report_subcommand():
    text = " ".join(run("sweep", "--help").stdout.split())
    assert "most trials this worker runs" in text and f"`sweep report`: {COMMANDS['sweep report'].description}" in text


@pytest.mark.parametrize("args, message", [
    (["frobnicate"], "soma_pl: error: unknown command 'frobnicate'"),
    (["bench", "nothing"], "soma_pl: error: unknown command 'bench nothing'"),
    (["analyze", "params", "--nope", "1"], "soma_pl: error: analyze params: "),
    (["bench", "zo", "--n_pert", "many"], "soma_pl: error: bench zo: "),
    (["bench", "zo", "--device", "cdua"], "soma_pl: error: --device=cdua is not a torch device"),
    (["bench", "kernels", "--device", "cuda:99"], "soma_pl: error: --device=cuda:99: "),
    (["evaluate", "--checkpoint", "x", "--text", "y", "--device", "cuda:99"], "soma_pl: error: --device=cuda:99: "),
])
def test_bad_input_is_one_line_and_exit_status_2(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith(message), result.stderr


def test_analyze_params_writes_table2(tmp_path):
    out = tmp_path / "params.json"
    result = run("analyze", "params", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {row["N"]: row for row in json.loads(out.read_text())["rows"]}
    assert {n: rows[n]["d_t"] for n in rows} == {1: 509, 2: 361, 8: 181, 256: 32}
    assert [rows[n]["expert_body_params"] for n in (1, 2, 8, 256)] == [8_325_713, 4_195_181, 1_060_841, 32_928]
    assert [rows[n]["ensemble_params"] for n in (1, 2, 8, 256)] == [8_333_905, 8_406_746, 8_552_264, 8_437_760]
    assert all(row["head_params_per_expert"] == 8_192 for row in rows.values())


def test_fit_prints_no_warning_about_its_arguments_or_wandb(tmp_path):
    write_jsonl_corpus(tmp_path / "corpus", {"alpha": 20, "beta": 20}, min_words=150, max_words=400)
    result = run("fit", "--config", "tests/lit/tiny_spsa.yaml", "--trainer.max_steps=2",
                 f"--data.init_args.dataset.corpus.paths=[{tmp_path / 'corpus'}]",
                 f"--data.init_args.dataset.output_dir={tmp_path / 'data'}",
                 f"--trainer.default_root_dir={tmp_path / 'run'}")  # checkpoints: <root>/checkpoints
    assert result.returncode == 0, result.stderr
    assert "args parameter" not in result.stderr and "anonymous" not in result.stderr
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("name, key, default", [("bench kernels", "shapes", "soma_pl.bench.kernels.DEFAULT_SHAPES"),
                                                ("bench inference", "models", "soma_pl.bench.inference.TABLE2_MODELS")])
def test_a_default_list_of_dataclasses_prints_and_parses_back(name, key, default, capsys):
    module, attribute = default.rsplit(".", 1)
    expected = tuple(getattr(importlib.import_module(module), attribute))
    with pytest.raises(SystemExit):
        main([*name.split(), "--print_config"])
    printed = capsys.readouterr()
    assert "Unable to serialize" not in printed.out + printed.err
    assert yaml.safe_load(printed.out)[key] == [dataclasses.asdict(d) for d in expected]
    parser = command_parser(name)
    assert tuple(parser.instantiate(parser.parse_args([]))[key]) == expected


@pytest.mark.parametrize("name", [name for name, command in COMMANDS.items() if command.module is not None])
def test_every_command_takes_progress(name):
    parser = command_parser(name)
    assert parser.get_defaults()["progress"] is True and "--progress" in parser.format_help()


def test_progress_false_is_accepted_by_a_command_that_shows_no_bar(tmp_path):
    out = tmp_path / "params.json"
    result = run("analyze", "params", "--progress", "false", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["rows"]


@pytest.mark.parametrize("progress", [True, False])
def test_the_round_robin_bar_of_the_benches_follows_progress(progress, capsys):
    from soma_pl.bench.memory import round_robin

    assert round_robin(len, [("ab",), ("abc",)], 1, "bench x", progress=progress) == [[2], [3]]
    assert ("bench x" in capsys.readouterr().err) is progress


def test_the_fit_help_names_one_config_file_that_exists():
    configs = re.findall(r"--config ([^\s`]+)", COMMANDS["fit"].description)
    assert len(configs) == 1 and (ROOT / configs[0]).is_file()


def test_fit_reads_progress_as_the_trainers_progress_bar():
    for value in (False, True):
        result = run("fit", "--config", "tests/lit/tiny_spsa.yaml", "--progress", str(value).lower(), "--print_config")
        assert result.returncode == 0, result.stderr
        assert yaml.safe_load(result.stdout)["trainer"]["enable_progress_bar"] is value


@pytest.mark.parametrize(("command", "heavy"), [
    ("sweep", ("lightning", "torch", "datatrove")), ("sweep report", ("lightning", "torch", "datatrove")),
    ("runs", ("lightning", "torch", "datatrove")), ("prepare", ("lightning", "torch", "datatrove")),
    ("shard", ("lightning", "torch", "datatrove")), ("evaluate", ("lightning", "datatrove")),
    ("generate", ("lightning", "datatrove")), ("export", ("lightning", "datatrove"))])
def test_help_of_a_command_imports_only_what_its_signature_needs(command, heavy):
    """Lightning's import takes about 4 s, torch's 1.5 s, datatrove's 0.5 s: a command imports them
    when it runs, not to print its `--help` (nor `sweep`'s runner, which starts trials that do)."""
    probe = ("import contextlib, io, sys\nfrom soma_pl.cli import main\n"
             "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
             f"    main({command.split()!r} + ['--help'])\n"
             f"print([name for name in {list(heavy)!r} if name in sys.modules])")
    answer = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert answer.stdout.strip().splitlines()[-1] == "[]"
