"""The tool subcommands through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "soma_pl.cli", *args], capture_output=True, text=True)


def test_analyze_params_writes_table2(tmp_path):
    out = tmp_path / "params.json"
    result = run("analyze", "params", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {row["N"]: row for row in json.loads(out.read_text())["rows"]}
    assert {n: rows[n]["d_t"] for n in rows} == {1: 509, 2: 361, 8: 181, 256: 32}
    assert [rows[n]["expert_body_params"] for n in (1, 2, 8, 256)] == [8_325_713, 4_195_181, 1_060_841, 32_928]
    assert [rows[n]["ensemble_params"] for n in (1, 2, 8, 256)] == [8_333_905, 8_406_746, 8_552_264, 8_437_760]
    assert all(row["head_params_per_expert"] == 8_192 for row in rows.values())


def test_unknown_command_and_subcommand_exit_nonzero():
    assert run("frobnicate").returncode == 2
    result = run("bench", "nothing")
    assert result.returncode != 0 and "bench" in result.stderr
