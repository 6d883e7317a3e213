"""A small JSONL corpus prepared once per session, and a runner for the real CLI in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from soma_pl.cli import main
from tests.data.corpora import write_jsonl_corpus

TINY = Path(__file__).with_name("tiny_spsa.yaml")
TINY_GRU = Path(__file__).with_name("tiny_gru.yaml")


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    write_jsonl_corpus(folder, {"alpha": 40, "beta": 40}, min_words=150, max_words=600)
    return folder


def fit_args(corpus: Path, data_dir: Path, run_dir: Path, *extra: str, config: Path = TINY) -> list[str]:
    return ["fit", "--config", str(config), f"--data.init_args.dataset.corpus.paths=[{corpus}]",
            f"--data.init_args.dataset.output_dir={data_dir}", f"--trainer.default_root_dir={run_dir}",
            "--trainer.logger=false", *extra]  # checkpoints go to <default_root_dir>/checkpoints


def run_cli(args: list[str]) -> None:
    main(args)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    return checkpoint["state_dict"]
