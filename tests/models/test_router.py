"""Router: encoders of the first 256 bytes (the paper's tf–idf one checked against scikit-learn run
by hand), nearest-centroid ranking, balanced clusters, save/load."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch

from soma_pl import ROUTE_BYTES, WINDOW_BYTES
from soma_pl.data.corpus.demo import iter_demo_documents
from soma_pl.data.sharding.assign import cut_sequences, fit_router
from soma_pl.errors import ConfigError, DataError
from soma_pl.models.router import HashedNgramEncoder, Router, TfidfEncoder, prefix_batch


def _windows(batch: int, seed: int = 0, length: int = WINDOW_BYTES) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=generator, dtype=torch.uint8)


@cache
def _text_windows() -> torch.Tensor:
    """The Python reference text cut into 1,025-byte windows (always present)."""
    windows, _ = cut_sequences([d.text for d in iter_demo_documents("python_docs")])
    return torch.from_numpy(windows)


@cache
def _fitted(experts: int = 5) -> tuple[Router, np.ndarray]:
    texts = [row[:-1].numpy().tobytes() for row in _text_windows()]
    return fit_router(texts, experts, seed=3, dim=32, min_df=2, n_init=2)


def _tfidf() -> TfidfEncoder:
    return _fitted()[0].encoder


ENCODERS = {"hashed": lambda: HashedNgramEncoder(dim=64, orders=(1, 2, 3), seed=3), "tfidf": _tfidf}


def _router(kind: str, experts: int = 5) -> Router:
    if kind == "tfidf":
        return _fitted(experts)[0]
    encoder = ENCODERS[kind]()
    return Router(encoder, encoder.encode(_windows(experts, seed=11)))  # each centroid is some window's encoding


def test_tfidf_router_equals_scikit_learn_run_by_hand():
    """tf–idf (App. D's settings) → SVD → mean removed, unit rows → balanced k-means, by hand."""
    from k_means_constrained import KMeansConstrained
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer

    router, labels = _fitted()
    texts = [row[:-1].numpy().tobytes() for row in _text_windows()]
    vectorizer = TfidfVectorizer(sublinear_tf=True, stop_words="english", min_df=2, max_features=50_000,
                                 decode_error="ignore")
    tfidf = vectorizer.fit_transform(texts)
    svd = TruncatedSVD(n_components=32, random_state=3).fit(tfidf)
    reduced = tfidf @ svd.components_.T
    mean = reduced.mean(0)

    def features(rows: list[bytes]) -> np.ndarray:
        z = vectorizer.transform(rows) @ svd.components_.T - mean
        return z / np.linalg.norm(z, axis=1, keepdims=True)

    hand = KMeansConstrained(n_clusters=5, size_min=len(texts) // 5, size_max=-(-len(texts) // 5), random_state=3,
                             n_init=2).fit(features(texts).astype(np.float32).astype(np.float64))
    assert np.array_equal(labels, hand.labels_)
    assert max(np.bincount(labels)) / min(np.bincount(labels)) <= 1.05
    centroids = hand.cluster_centers_ / np.linalg.norm(hand.cluster_centers_, axis=1, keepdims=True)
    prefixes = [t[:ROUTE_BYTES] for t in texts]
    expected = (features(prefixes) @ centroids.T).argmax(1)
    assert np.array_equal(router.top_k(_text_windows(), 1)[:, 0].numpy(), expected)


def test_a_text_with_no_known_word_still_routes():
    router = _fitted()[0]
    assert router.top_k(torch.zeros(2, ROUTE_BYTES, dtype=torch.uint8), 2).shape == (2, 2)


def test_sequences_without_words_are_a_data_error():
    with pytest.raises(DataError, match="vocabulary"):
        fit_router([b"\x00\x01" * 512] * 8, 2)


@pytest.mark.parametrize("kind", sorted(ENCODERS))
def test_encoding_reads_only_the_first_256_bytes(kind):
    encoder = ENCODERS[kind]()
    windows = _text_windows()[:4]
    changed = windows.clone()
    changed[:, ROUTE_BYTES:] = _text_windows()[10:14, ROUTE_BYTES:]
    encoded = encoder.encode(windows)
    assert encoded.shape == (4, encoder.output_dim) and encoded.dtype == torch.float32
    assert torch.equal(encoded, encoder.encode(changed))
    assert torch.equal(encoded, encoder.encode(windows[:, :ROUTE_BYTES].contiguous()))
    other = windows.clone()
    other[:, :ROUTE_BYTES] = _text_windows()[20:24, :ROUTE_BYTES]
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


@pytest.mark.parametrize("kind", sorted(ENCODERS))
def test_ranking_follows_scores_and_top_k_is_deterministic(kind):
    router = _router(kind)
    windows = _text_windows()[:8]
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
    windows = _text_windows()[:16]
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


def test_prefix_batch_cuts_the_routed_bytes():
    texts = [bytes(range(256)) * 2, b"x" * 300]
    batch = prefix_batch(texts)
    assert batch.shape == (2, ROUTE_BYTES) and batch.dtype == torch.uint8
    assert bytes(batch[0].tolist()) == bytes(range(256)) and bytes(batch[1].tolist()) == b"x" * 256
    with pytest.raises(ValueError, match="shorter"):
        prefix_batch([b"short"])
