"""Router: encoders of the first 256 bytes, nearest-centroid ranking, save/load, seed checkpoints."""

from __future__ import annotations

import pytest
import torch

from soma_pl import ROUTE_BYTES, WINDOW_BYTES
from soma_pl.errors import ConfigError, DataError
from soma_pl.lit import BPTTModule, ModelShape
from soma_pl.models.router import HashedNgramEncoder, Router, SeedEncoder, prefix_batch
from soma_pl.models.stacked import StackedExperts


def _windows(batch: int, seed: int = 0, length: int = WINDOW_BYTES) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=generator, dtype=torch.uint8)


def _seed_encoder() -> SeedEncoder:
    torch.manual_seed(0)
    return SeedEncoder(StackedExperts(1, width=16, num_layers=2))


def _fitted_hashed() -> HashedNgramEncoder:
    encoder = HashedNgramEncoder(dim=64, orders=(1, 2, 3), seed=3)
    encoder.fit_center(encoder.encode(_windows(32, seed=5)))
    return encoder


ENCODERS = {"hashed": _fitted_hashed, "seed": _seed_encoder}


def _router(kind: str, experts: int = 5) -> Router:
    encoder = ENCODERS[kind]()
    centroids = encoder.encode(_windows(experts, seed=11))  # each centroid is some window's encoding
    return Router(encoder, centroids)


def _save_lightning_checkpoint(path, width: int = 16, num_layers: int = 2, num_experts: int = 1) -> BPTTModule:
    """What Lightning writes for a monolithic module: `model.*` weights and the init hyper-parameters."""
    torch.manual_seed(1)
    module = BPTTModule(shape=ModelShape(width=width, num_layers=num_layers), num_experts=num_experts)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return module


@pytest.mark.parametrize("kind", sorted(ENCODERS))
def test_encoding_reads_only_the_first_256_bytes(kind):
    encoder = ENCODERS[kind]()
    windows = _windows(4)
    changed = windows.clone()
    changed[:, ROUTE_BYTES:] = _windows(4, seed=9)[:, ROUTE_BYTES:]
    encoded = encoder.encode(windows)
    assert encoded.shape == (4, encoder.output_dim) and encoded.dtype == torch.float32
    assert torch.equal(encoded, encoder.encode(changed))
    assert torch.equal(encoded, encoder.encode(windows[:, :ROUTE_BYTES].contiguous()))
    other = windows.clone()
    other[:, 10] ^= 1
    assert not torch.equal(encoded, encoder.encode(other))
    with pytest.raises(ValueError, match="256"):
        encoder.encode(windows[:, : ROUTE_BYTES - 1])


def test_hashed_encoder_is_a_unit_vector_of_ngram_counts():
    encoder = HashedNgramEncoder(dim=32, orders=(1,), seed=0)
    uniform = torch.full((1, ROUTE_BYTES), 7, dtype=torch.uint8)
    encoded = encoder.encode(uniform)[0]
    assert torch.count_nonzero(encoded) == 1 and torch.isclose(encoded.max(), torch.tensor(1.0))
    assert torch.allclose(encoder.encode(_windows(6)).norm(dim=1), torch.ones(6))
    same_seed = HashedNgramEncoder(dim=32, orders=(1,), seed=0).encode(_windows(3))
    assert torch.equal(same_seed, encoder.encode(_windows(3)))


def test_fit_center_matches_encode_and_refuses_twice():
    encoder = HashedNgramEncoder(dim=64, seed=1)
    windows = _windows(20)
    centred = encoder.fit_center(encoder.encode(windows))
    assert torch.allclose(centred, encoder.encode(windows), atol=1e-6)
    assert torch.allclose(centred.norm(dim=1), torch.ones(20))
    with pytest.raises(ValueError, match="already centred"):
        encoder.fit_center(centred)


@pytest.mark.parametrize("kind", sorted(ENCODERS))
def test_ranking_follows_scores_and_top_k_is_deterministic(kind):
    router = _router(kind)
    windows = _windows(8, seed=2)
    scores, ranking = router.scores(windows), router.ranking(windows)
    assert scores.shape == ranking.shape == (8, 5)
    ordered = scores.gather(1, ranking)
    assert torch.all(ordered[:, :-1] >= ordered[:, 1:])
    assert torch.equal(ranking, router.ranking(windows))
    assert torch.equal(router.top_k(windows, 3), ranking[:, :3])
    assert torch.equal(router.top_k(windows, 1)[:, 0], scores.argmax(1))
    with pytest.raises(ConfigError, match="k=6"):
        router.top_k(windows, 6)


def test_a_window_goes_to_its_own_centroid_first():
    encoder = HashedNgramEncoder(dim=128)
    windows = _windows(4, seed=4)
    router = Router(encoder, encoder.encode(windows))
    assert router.top_k(windows, 1)[:, 0].tolist() == [0, 1, 2, 3]


def test_ties_are_broken_by_the_lower_expert_index():
    encoder = HashedNgramEncoder(dim=64)
    a, b = encoder.encode(_windows(2, seed=6))
    router = Router(encoder, torch.stack([b, a, b, a, a]))  # experts 1, 3, 4 tie, and 0, 2
    windows = _windows(1, seed=6)[:1]  # encodes to `a` exactly
    assert router.ranking(windows)[0].tolist() == [1, 3, 4, 0, 2]


@pytest.mark.parametrize("kind", sorted(ENCODERS))
def test_save_load_round_trip_gives_identical_rankings(kind, tmp_path):
    router = _router(kind)
    path = router.save(tmp_path / "router.pt")
    loaded = Router.load(path)
    windows = _windows(16, seed=8)
    assert type(loaded.encoder) is type(router.encoder) and loaded.num_experts == 5
    assert torch.equal(loaded.scores(windows), router.scores(windows))
    assert torch.equal(loaded.ranking(windows), router.ranking(windows))
    assert not list(tmp_path.glob(".*tmp*")), "the temporary file is renamed into place"


def test_corrupt_or_missing_router_file_is_a_data_error(tmp_path):
    path = _router("hashed").save(tmp_path / "router.pt")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataError, match="corrupt router file .*router.pt"):
        Router.load(path)
    (tmp_path / "junk.pt").write_bytes(b"not a router")
    with pytest.raises(DataError, match="junk.pt"):
        Router.load(tmp_path / "junk.pt")
    torch.save({"format": 1, "centroids": torch.zeros(2, 3)}, tmp_path / "partial.pt")
    with pytest.raises(DataError, match="partial.pt"):
        Router.load(tmp_path / "partial.pt")
    with pytest.raises(DataError, match="router file not found: .*absent.pt"):
        Router.load(tmp_path / "absent.pt")


def test_centroids_must_match_the_encoder_width():
    with pytest.raises(ConfigError, match=r"\[N, 64\]"):
        Router(HashedNgramEncoder(dim=64), torch.zeros(3, 32))


def test_seed_encoder_from_a_lightning_checkpoint(tmp_path):
    module = _save_lightning_checkpoint(tmp_path / "seed.ckpt")
    encoder = SeedEncoder.from_checkpoint(tmp_path / "seed.ckpt")
    assert encoder.config() == {"width": 16, "num_layers": 2, "embed_dim": 32, "head": "per_expert"}
    assert not any(p.requires_grad for p in encoder.parameters())
    windows = _windows(3)
    expected = torch.cat(list(module.model.features(module.model.group_parameters({}, 1), windows[None, :, :256])), 2)
    assert torch.allclose(encoder.encode(windows), expected[0].mean(1), atol=1e-6)


def test_seed_checkpoint_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="seed checkpoint not found: .*none.ckpt"):
        SeedEncoder.from_checkpoint(tmp_path / "none.ckpt")
    (tmp_path / "bad.ckpt").write_bytes(b"\x00" * 10)
    with pytest.raises(DataError, match="unreadable seed checkpoint .*bad.ckpt"):
        SeedEncoder.from_checkpoint(tmp_path / "bad.ckpt")
    _save_lightning_checkpoint(tmp_path / "ensemble.ckpt", num_experts=2)
    with pytest.raises(ConfigError, match="ensemble.ckpt: no monolithic model"):
        SeedEncoder.from_checkpoint(tmp_path / "ensemble.ckpt")


def test_prefix_batch_cuts_the_routed_bytes():
    texts = [bytes(range(256)) * 2, b"x" * 300]
    batch = prefix_batch(texts)
    assert batch.shape == (2, ROUTE_BYTES) and batch.dtype == torch.uint8
    assert bytes(batch[0].tolist()) == bytes(range(256)) and bytes(batch[1].tolist()) == b"x" * 256
    with pytest.raises(ValueError, match="shorter"):
        prefix_batch([b"short"])
