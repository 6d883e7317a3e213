"""Which expert each document goes to: mini-batch k-means on the (centred) encodings of the first
256 bytes with rebalancing (semantic sharding, the paper's), or a seeded deal (random sharding, the
Fig. 9 ablation); and the router's centroids."""

from __future__ import annotations

import numpy as np

from soma_pl.data.sharding.config import ShardConfig, Sharding


def assign_labels(config: ShardConfig, embeddings: np.ndarray, deal_keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Each document's expert `[n]` int64, and how many documents rebalancing moved: k-means on
    the (centred) `embeddings`, or for random sharding a deal in the order of the `deal_keys`."""
    experts, count = config.num_experts, len(embeddings)
    if Sharding(config.sharding) is Sharding.random:
        return deal(deal_keys, experts), 0
    from sklearn.cluster import MiniBatchKMeans

    kmeans = MiniBatchKMeans(n_clusters=experts, random_state=config.seed, n_init=config.kmeans_n_init,
                             batch_size=config.kmeans_batch_size)
    labels = kmeans.fit_predict(embeddings).astype(np.int64)
    minimum = max(1, int(config.min_expert_fraction * count / experts))
    return rebalance(labels, kmeans.transform(embeddings), minimum)


def assign_expert_val(config: ShardConfig, embeddings: np.ndarray, deal_keys: np.ndarray,
                      centroids: np.ndarray) -> tuple[np.ndarray, int]:
    """Each expert-validation document's expert `[n]` int64, and how many rebalancing moved.

    The rule that placed the training documents, with the fitted `centroids` `[N, D]` in place of
    a new k-means fit: each document goes to its nearest centroid, then an expert holding fewer
    than `min_expert_fraction` of the average, and at least one, takes the documents nearest its
    centroid from experts that hold more (`rebalance`), so no expert is left without a decay
    signal; for random sharding the same seeded deal in the order of the `deal_keys`. Needs at
    least N documents (`check_splits`).

    Args:
        embeddings: `[n, D]` the documents' centred encodings.
        deal_keys: `[n]` uint64 their seeded deal keys.
        centroids: `[N, D]` the fitted centroids (each expert's mean over its training sample).
    """
    experts, count = config.num_experts, len(embeddings)
    if Sharding(config.sharding) is Sharding.random:
        return deal(deal_keys, experts), 0
    distances = centroid_distances(embeddings, centroids)
    minimum = max(1, int(config.min_expert_fraction * count / experts))
    return rebalance(distances.argmin(axis=1).astype(np.int64), distances, minimum)


def deal(deal_keys: np.ndarray, experts: int) -> np.ndarray:
    """Random sharding: documents dealt to experts round-robin in the order of their seeded deal
    keys `[n]`, so the experts' counts differ by at most one. `[n]` int64."""
    labels = np.empty(len(deal_keys), dtype=np.int64)
    labels[np.argsort(deal_keys, kind="stable")] = np.arange(len(deal_keys)) % experts
    return labels


def centroid_distances(embeddings: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """`[n, N]` squared Euclidean distance of each embedding `[n, D]` to each centroid `[N, D]`."""
    embeddings = np.asarray(embeddings, dtype=np.float64)
    return ((embeddings ** 2).sum(1)[:, None] + (centroids.astype(np.float64) ** 2).sum(1)[None]
            - 2 * embeddings @ centroids.T.astype(np.float64))


def rebalance(labels: np.ndarray, distances: np.ndarray, minimum: int) -> tuple[np.ndarray, int]:
    """Give every expert at least `minimum` documents.

    An expert below it takes, nearest to its centroid first, documents from experts holding more
    than `minimum`, so no donor falls below it (feasible whenever `minimum · N ≤ n`).

    Args:
        labels: `[n]` expert of each document.
        distances: `[n, N]` distance of each document to each centroid.
        minimum: least documents per expert.

    Returns:
        the new labels `[n]` and the number of documents moved.
    """
    labels = labels.copy()
    counts = np.bincount(labels, minlength=distances.shape[1])
    moved = 0
    for expert in range(distances.shape[1]):
        for document in np.argsort(distances[:, expert], kind="stable"):
            if counts[expert] >= minimum:
                break
            donor = labels[document]
            if donor != expert and counts[donor] > minimum:
                labels[document] = expert
                counts[donor] -= 1
                counts[expert] += 1
                moved += 1
    return labels, moved


def expert_centroids(embeddings: np.ndarray, labels: np.ndarray, experts: int) -> np.ndarray:
    """Mean embedding of each expert's documents: `[N, D]` float32 (the router's centroids)."""
    sums = np.zeros((experts, embeddings.shape[1]), dtype=np.float64)
    np.add.at(sums, labels, embeddings)
    counts = np.bincount(labels, minlength=experts)[:, None]
    return (sums / np.maximum(counts, 1)).astype(np.float32)
