"""Which expert each 1,024-byte sequence goes to, and which sequences each expert holds out.

Semantic sharding (§4, App. D): word-level tf–idf of the sample's sequences → truncated SVD →
mean removed, unit length → balanced k-means (`k_means_constrained`: sizes ⌊n/N⌋ or ⌈n/N⌉) whose
centroids, scaled to unit length, route by cosine. A sampled sequence keeps its balanced cluster;
any other goes to its nearest centroid. Random sharding (the Fig. 9 ablation) deals sequences by a
seeded hash. Within each expert, the sequences of smallest key form its expert-validation share.
"""

from __future__ import annotations

import numpy as np
import torch

from soma_pl import WINDOW_BYTES
from soma_pl.errors import DataError
from soma_pl.models.router import VECTORIZER, Router, TfidfEncoder

SEQUENCE_BYTES = WINDOW_BYTES - 1
"""The unit of assignment (App. D): a 1,024-byte sequence; its training window adds the next byte."""

_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def sequence_keys(seed: int, file: int, count: int) -> np.ndarray:
    """`[count]` uint64 keys of sequences 0..count-1 of prepared shard file `file` (splitmix64 of
    seed, file and position): they choose the fitting sample and the expert-validation shares."""
    with np.errstate(over="ignore"):
        x = (np.uint64(seed) * _MIX[1] + np.uint64(file) * _MIX[0]
             + np.arange(count, dtype=np.uint64) * _MIX[2] + _MIX[0])
        x = (x ^ (x >> np.uint64(30))) * _MIX[1]
        x = (x ^ (x >> np.uint64(27))) * _MIX[2]
        return x ^ (x >> np.uint64(31))


def cut_sequences(texts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Documents joined end to end, cut into non-overlapping 1,024-byte sequences from the first byte,
    each window the sequence and the byte after it: `(windows [n, 1025] uint8, the document each
    sequence starts in [n])`. Only the last < 1,025 bytes are left over."""
    stream = np.frombuffer(b"".join(texts), dtype=np.uint8)
    count = max(0, (len(stream) - 1) // SEQUENCE_BYTES)
    if not count:
        return np.zeros((0, WINDOW_BYTES), dtype=np.uint8), np.zeros(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(stream, WINDOW_BYTES)[::SEQUENCE_BYTES][:count]
    starts = np.cumsum([0, *(len(text) for text in texts[:-1])])
    return np.ascontiguousarray(windows), np.searchsorted(starts, np.arange(count) * SEQUENCE_BYTES, "right") - 1


def deal(keys: np.ndarray, experts: int) -> np.ndarray:
    """Random sharding: each sequence's expert from its key `[n]` int64 (independent of the sample)."""
    return ((keys >> np.uint64(17)) % np.uint64(experts)).astype(np.int64)


def fit_router(texts: list[bytes], experts: int, seed: int = 0, dim: int = 128, max_features: int = 50_000,
               min_df: int = 5, n_init: int = 10, labels: np.ndarray | None = None) -> tuple[Router, np.ndarray]:
    """Fit the router on the sample's sequences: `(router, each sequence's balanced cluster [n])`.
    Given `labels` (random sharding), the encoder is fitted and each centroid is its expert's mean.

    Raises:
        DataError: the texts give no vocabulary, or fewer sequences than experts.
    """
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):  # the same bits whatever cores an executor's task is given
        return _fit_router(texts, experts, seed, dim, max_features, min_df, n_init, labels)


def _fit_router(texts: list[bytes], experts: int, seed: int, dim: int, max_features: int, min_df: int, n_init: int,
                labels: np.ndarray | None) -> tuple[Router, np.ndarray]:
    from k_means_constrained import KMeansConstrained
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer

    if len(texts) < experts:
        raise DataError(f"{len(texts)} sequences to cluster into {experts} experts")
    vectorizer = TfidfVectorizer(max_features=max_features, min_df=min(min_df, len(texts)), **VECTORIZER)
    try:
        tfidf = vectorizer.fit_transform(texts)
    except ValueError as error:  # sklearn: "empty vocabulary; perhaps the documents only contain stop words"
        raise DataError(f"the sequences give no tf-idf vocabulary ({error}): a larger or wordier corpus, "
                        "or a smaller shard.tfidf_min_df") from error
    svd = TruncatedSVD(n_components=max(1, min(dim, tfidf.shape[1] - 1)), random_state=seed).fit(tfidf)
    encoder = TfidfEncoder(vectorizer.get_feature_names_out().tolist(), svd.components_.shape[0])
    reduced = tfidf @ svd.components_.T  # what `TfidfEncoder.features` computes
    encoder.load_state_dict({"idf": torch.from_numpy(vectorizer.idf_), "components": torch.from_numpy(svd.components_),
                             "mean": torch.from_numpy(reduced.mean(0))})
    features = encoder.features(texts)
    if experts == 1 or labels is not None:
        labels = np.zeros(len(texts), np.int64) if labels is None else labels
        sums = np.zeros((experts, features.shape[1]))
        np.add.at(sums, labels, features)
        return Router(encoder, torch.from_numpy(_unit(sums).astype(np.float32))), labels
    kmeans = KMeansConstrained(n_clusters=experts, size_min=len(texts) // experts, size_max=-(-len(texts) // experts),
                               random_state=seed, n_init=n_init)
    labels = kmeans.fit_predict(features.astype(np.float64)).astype(np.int64)
    return Router(encoder, torch.from_numpy(_unit(kmeans.cluster_centers_).astype(np.float32))), labels


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


def nearest(router: Router, texts: list[bytes]) -> np.ndarray:
    """Each text's most cosine-similar centroid `[n]` int64 (ties: the lower index)."""
    if not texts:
        return np.zeros(0, dtype=np.int64)
    scores = router.encoder.features(texts) @ router.centroids.cpu().numpy().T
    return scores.argmax(axis=1).astype(np.int64)


def held_out_thresholds(labels: np.ndarray, keys: np.ndarray, experts: int, fraction: float) -> np.ndarray:
    """Per expert, the largest key of its expert-validation share `[N]` uint64: its
    max(1, round(fraction · n_e)) sequences of smallest key (none for an expert of one sequence).

    Raises:
        DataError: an expert received no sequence.
    """
    counts = np.bincount(labels, minlength=experts)
    if not counts.all():
        raise DataError(f"expert {int(np.argmin(counts))} received no sequence: fewer experts or a larger corpus")
    ordered = keys[np.lexsort((keys, labels))]  # by expert, then key
    held = np.minimum(np.maximum(1, np.round(fraction * counts).astype(np.int64)), counts - 1)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return np.where(held > 0, ordered[np.maximum(starts + held - 1, 0)], np.uint64(0)).astype(np.uint64)
