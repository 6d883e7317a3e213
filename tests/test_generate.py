"""`generate`: incremental sampling checked against full forward passes, seeds, routing, bad input."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from soma_pl import ROUTE_BYTES
from soma_pl.cli import main
from soma_pl.eval.ensemble import ensemble_probabilities
from soma_pl.generate import SamplingArgs, next_byte
from soma_pl.lit import ModelShape, ZOModule
from soma_pl.lit.loading import load_module
from soma_pl.models.router import Router, prefix_batch
from soma_pl.models.stacked import StackedExperts
from tests.robustness.cli import cli, one_error
from tests.tiny_checkpoints import OTHER_METHODS, PROMPT, ROUTED, module_checkpoint, tiny_checkpoints


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.getbasetemp() / "tiny_checkpoints")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompt") / "prompt.txt"
    path.write_bytes(PROMPT)
    return path


def _generate(capsys, folder: Path, *args: object) -> dict:
    """Run `generate` with `--out` in `folder`; check that stdout is the continuation; return the JSON record."""
    out = folder / "generated.json"
    capsys.readouterr()
    main(["generate", *map(str, args), "--out", str(out)])
    record = json.loads(out.read_text())
    assert capsys.readouterr().out == record["text"] + "\n"
    generated = bytes.fromhex(record["bytes_hex"])
    assert len(generated) == record["max_bytes"] and record["text"] == generated.decode("utf-8", errors="replace")
    return record


def _full_forward_argmax(module, prompt: bytes, generated: bytes, k: int) -> bytes:
    """The most probable byte at every generated position under one full forward pass of every expert
    over prompt + generated, averaging the probabilities of the window's top-k experts."""
    text = torch.frombuffer(bytearray(prompt + generated), dtype=torch.uint8)[None]
    probs = ensemble_probabilities(module.model, module.ranking(text), text, k)[0]  # [T, 256]
    return bytes(probs[len(prompt) - 1 : -1].argmax(-1).tolist())


def _check_greedy(module, record: dict, prompt: bytes) -> None:
    generated = bytes.fromhex(record["bytes_hex"])
    assert len(set(generated)) >= 3, generated  # a continuation that varies: the comparison can fail
    assert generated == _full_forward_argmax(module, prompt, generated, len(record["experts"]))


@pytest.mark.parametrize("method", ["spsa", "soma"])
def test_greedy_is_the_argmax_of_a_full_forward_pass(tiny, prompt_file, method, tmp_path, capsys):
    checkpoint = getattr(tiny, method)
    record = _generate(capsys, tmp_path, "--checkpoint", checkpoint, "--prompt_file", prompt_file, "--temperature", "0",
                       "--max_bytes", "40")
    module = load_module(checkpoint)
    assert record["experts"] == module.ranking(prefix_batch([PROMPT]))[0, : module.eval_k].tolist()
    assert len(record["experts"]) == (2 if method == "soma" else 1)
    _check_greedy(module, record, PROMPT)


@pytest.mark.parametrize("method", sorted(OTHER_METHODS))
def test_every_methods_checkpoint_generates_its_greedy_continuation(method, prompt_file, tmp_path, capsys):
    torch.manual_seed(4)  # weights whose greedy continuation varies (seeds 0, 3, 5 repeat one byte)
    module = OTHER_METHODS[method]()
    checkpoint = module_checkpoint(module, tmp_path / f"{method}.ckpt")
    record = _generate(capsys, tmp_path, "--checkpoint", checkpoint, "--prompt_file", prompt_file, "--temperature", "0",
                       "--max_bytes", "24")
    assert record["module"] == type(module).__name__
    assert record["routed"] == (method in ROUTED) and len(record["experts"]) == (2 if method in ROUTED else 1)
    _check_greedy(module.eval(), record, PROMPT)


def test_the_same_seed_gives_the_same_text_and_another_seed_another(tiny, prompt_file, tmp_path, capsys):
    def sample(seed: int) -> str:
        return _generate(capsys, tmp_path, "--checkpoint", tiny.soma, "--prompt_file", prompt_file, "--seed", seed,
                         "--max_bytes", "48")["bytes_hex"]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_a_soma_top_1_generation_is_the_chosen_experts_own(tiny, prompt_file, tmp_path, capsys):
    payload = torch.load(tiny.soma, map_location="cpu", weights_only=False)
    shape = ModelShape(**payload["hyper_parameters"]["shape"])
    sampled = ["--seed", "3", "--max_bytes", "40"]
    alone = {}
    for expert in (0, 1):  # each expert alone, as a monolithic SPSA checkpoint
        single = ZOModule(shape=shape)
        single.model.load_state_dict({name.removeprefix("model."): value[expert : expert + 1]
                                      for name, value in payload["state_dict"].items() if name.startswith("model.")})
        alone[expert] = module_checkpoint(single, tmp_path / f"expert{expert}.ckpt", sharpen=False)
    own = {expert: _generate(capsys, tmp_path, "--checkpoint", checkpoint, "--prompt_file", prompt_file,
                             *sampled)["bytes_hex"] for expert, checkpoint in alone.items()}
    assert own[0] != own[1]
    chosen = int(Router.load(tiny.router).ranking(prefix_batch([PROMPT]))[0, 0])
    routed = _generate(capsys, tmp_path, "--checkpoint", tiny.soma, "--prompt_file", prompt_file, "--top_k", "1",
                       *sampled)
    assert routed["experts"] == [chosen] and routed["bytes_hex"] == own[chosen]
    other = 1 - chosen  # named instead of routed: a prompt shorter than the routed bytes is fine
    named = _generate(capsys, tmp_path, "--checkpoint", tiny.soma, "--prompt", "short", "--experts", f"[{other}]",
                      *sampled)
    assert named["experts"] == [other] and not named["routed"]
    assert named["bytes_hex"] == _generate(capsys, tmp_path, "--checkpoint", alone[other], "--prompt", "short",
                                           *sampled)["bytes_hex"]


def test_each_byte_is_drawn_from_the_full_forward_passs_distribution(tiny, prompt_file, monkeypatch, tmp_path,
                                                                     capsys):
    drawn_from = []

    def recorded(log_probs, sampling, generator):
        drawn_from.append(log_probs)
        return next_byte(log_probs, sampling, generator)

    monkeypatch.setattr("soma_pl.generate.next_byte", recorded)
    record = _generate(capsys, tmp_path, "--checkpoint", tiny.soma, "--prompt_file", prompt_file, "--max_bytes", "40")
    generated = bytes.fromhex(record["bytes_hex"])
    assert len(set(generated)) >= 10  # sampled at temperature 1: the states differ from byte to byte
    module = load_module(tiny.soma)
    text = torch.frombuffer(bytearray(PROMPT + generated), dtype=torch.uint8)[None]
    probs = ensemble_probabilities(module.model, module.ranking(text), text, k=2)[0, len(PROMPT) - 1 : -1]
    torch.testing.assert_close(torch.stack(drawn_from).exp(), probs, rtol=1e-4, atol=1e-6)


def test_the_prompt_runs_once_and_each_new_byte_is_one_step(tiny, prompt_file, monkeypatch, tmp_path, capsys):
    steps = []
    features = StackedExperts.features

    def counted(self, params, tokens, *args, **kwargs):
        steps.append(tokens.shape[2])
        return features(self, params, tokens, *args, **kwargs)

    monkeypatch.setattr(StackedExperts, "features", counted)
    _generate(capsys, tmp_path, "--checkpoint", tiny.soma, "--prompt_file", prompt_file, "--max_bytes", "30")
    assert steps[-30:] == [len(PROMPT)] + [1] * 29  # routing may run the seed encoder first; never the prefix again


def test_the_sampler_draws_from_the_filtered_tempered_distribution():
    probs = torch.zeros(256)
    probs[[7, 3, 200]] = torch.tensor([0.5, 0.3, 0.2])
    log_probs, generator, draws = probs.log(), torch.Generator().manual_seed(0), 4000

    def frequencies(**settings) -> dict[int, float]:
        counts = Counter(next_byte(log_probs, SamplingArgs(**settings), generator) for _ in range(draws))
        return {byte: count / draws for byte, count in counts.items()}

    nucleus = frequencies(top_p=0.7)  # 0.5 + 0.3 reach 0.7: byte 200 is left out, the rest renormalised
    assert set(nucleus) == {7, 3} and nucleus[7] == pytest.approx(0.625, abs=0.03)
    top_two = frequencies(top_k_bytes=2)
    assert set(top_two) == {7, 3} and top_two[3] == pytest.approx(0.375, abs=0.03)
    tempered = frequencies(temperature=0.5)  # p² renormalised: 0.25, 0.09, 0.04 over 0.38
    assert tempered[7] == pytest.approx(0.25 / 0.38, abs=0.03) and tempered[200] == pytest.approx(0.04 / 0.38, abs=0.02)
    assert frequencies(temperature=0) == frequencies(top_k_bytes=1) == frequencies(top_p=0.01) == {7: 1.0}


def test_bad_input_is_one_error_line(tiny, prompt_file, tmp_path, capsys):
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    (tmp_path / "empty.txt").write_bytes(b"")
    run = ["generate", "--checkpoint", str(tiny.spsa)]
    one_error(cli(capsys, "generate", "--checkpoint", str(garbage), "--prompt", "x"), "unreadable checkpoint",
              str(garbage))
    one_error(cli(capsys, "generate", "--checkpoint", str(tmp_path / "missing.ckpt"), "--prompt", "x"), "not found")
    one_error(cli(capsys, *run, "--prompt", ""), "empty prompt")
    one_error(cli(capsys, *run), "empty prompt")
    one_error(cli(capsys, *run, "--prompt_file", str(tmp_path / "empty.txt")), "empty prompt", "empty.txt")
    one_error(cli(capsys, *run, "--prompt_file", str(tmp_path / "nope.txt")), "cannot read --prompt_file")
    one_error(cli(capsys, *run, "--prompt", "x", "--prompt_file", str(prompt_file)), "not both")
    one_error(cli(capsys, *run, "--prompt", "x", "--temperature", "-1"), "--temperature=-1.0 must be >= 0")
    one_error(cli(capsys, *run, "--prompt", "x", "--top_p", "0"), "--top_p=0.0")
    one_error(cli(capsys, *run, "--prompt", "x", "--top_k_bytes", "300"), "--top_k_bytes=300")
    one_error(cli(capsys, *run, "--prompt", "x", "--max_bytes", "0"), "--max_bytes=0")
    one_error(cli(capsys, *run, "--prompt", "x", "--top_k", "2"), "top_k=2", "averages 1..1")
    soma = ["generate", "--checkpoint", str(tiny.soma)]
    one_error(cli(capsys, *soma, "--prompt", "short"), "the prompt has 5 bytes", f"first {ROUTE_BYTES}", "--experts")
    one_error(cli(capsys, *soma, "--prompt", "x", "--experts", "[0, 2]"), "distinct experts of 0..1")
    one_error(cli(capsys, *soma, "--prompt", "x", "--experts", "[1]", "--top_k", "1"), "not both")
    payload = torch.load(tiny.soma, map_location="cpu", weights_only=False)
    del payload["router"]  # a checkpoint written before the module had its router
    payload["state_dict"] = {name: value for name, value in payload["state_dict"].items()
                             if not name.startswith("routing.router.")}
    torch.save(payload, tmp_path / "no_router.ckpt")
    one_error(cli(capsys, "generate", "--checkpoint", str(tmp_path / "no_router.ckpt"), "--prompt_file",
                  str(prompt_file)), "carries no router", "--router")
    out = tmp_path / "out.json"
    out.mkdir()
    one_error(cli(capsys, *run, "--prompt", "x", "--out", str(out)), "is a folder")
