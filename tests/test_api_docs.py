"""docs/api.md as a reader runs it: every ```python block, in order, in one namespace, in an empty
folder. The blocks end in asserts on what they produced (a loss below the untrained model's, a
checkpoint that reloads to the same score, a router that sends each genre to its own expert, a
table of both runs); here we also check the files they left."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a markdown text, in order."""
    return BLOCK.findall(text)


def test_the_block_finder_reads_only_python_blocks():
    text = "# t\n```python\nx = 1\n```\n\n```bash\nls\n```\n```python\nassert x == 1\n```\n"
    assert python_blocks(text) == ["x = 1\n", "assert x == 1\n"]


def test_the_api_page_runs_as_written(tmp_path, monkeypatch):
    blocks = python_blocks(API.read_text())
    assert len(blocks) == 5
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a toy model: more threads only wait on each other on a shared CPU
    namespace: dict = {"__name__": "__main__"}
    try:
        for number, block in enumerate(blocks, start=1):
            exec(compile(block, f"docs/api.md, python block {number}", "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
    for run, experts in (("spsa", 1), ("soma", 2)):
        assert (tmp_path / "runs" / run / "checkpoints" / "last.ckpt").is_file()
        summary = json.loads((tmp_path / "runs" / run / "version_0" / "summary.json").read_text())
        assert summary["compute"]["updates"] == 24 and summary["compute"]["experts"] == experts
    assert (tmp_path / "experts" / "router.pt").is_file() and (tmp_path / "runs" / "curves.png").stat().st_size > 10_000
