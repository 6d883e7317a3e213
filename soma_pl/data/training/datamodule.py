"""`ByteDataModule`: training windows streamed from shards, fixed evaluation windows.

Training batches are `[E, B, 1025] uint8` (E = 1 for a monolithic model; E = N expert streams when
`experts_dir` names a sharded dataset). Validation and test batches are `(windows [b, 1025] uint8,
index [b])` from the prepared ensemble-validation and test sets (`test_split`: the test split, or
the final one that only a reproduction's final runs report).

Under DDP the module in training decides how ranks share the stream (its `rank_split`, see
`RankSplit`): disjoint documents (default), one replicated global stream (DDPP), or each rank its
own experts (expert-parallel SOMA, whose ranks then also evaluate only their own experts'
expert-validation windows, every batch of them).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from soma_pl import WINDOW_BYTES
from soma_pl.contracts import SplitsRanks
from soma_pl.data.formats.evalsets import EvalSet
from soma_pl.data.formats.expert_sets import check_sharded_from, expert_shards, read_experts_manifest
from soma_pl.data.formats.manifest import load_eval_set, open_prepared, read_manifest
from soma_pl.data.formats.tar_shards import ShardRecord, Verify, verify_shards
from soma_pl.data.preparation.config import PrepareConfig, recipe_config
from soma_pl.data.preparation.prepare import prepare, prepare_recipe
from soma_pl.data.training.stream import WindowStream, fixed_windows
from soma_pl.distributed import RankSplit, rank_share
from soma_pl.errors import ConfigError, DataError
from soma_pl.models.checkpoints import check_same_data

TEST_SPLITS = {"test": "test", "final": "test_final"}
"""`test_split` choices and the manifest entry each one reads."""


class ByteDataModule(L.LightningDataModule):
    """Byte-level windows for ZO and BPTT training.

    Args:
        prepared: a prepared dataset folder, used by path alone: everything is read from its
            manifest, so `dataset` must be left unset. A folder from another soma_pl version is refused.
        recipe: a data config (`configs/data/<name>.yaml`) that builds `prepared` on first use (once
            per job, by global rank 0) when it is missing or was built from another corpus or config.
        dataset: what `prepare` builds when `prepared` is not given; prepared on first use when
            `auto_prepare` is on.
        experts_dir: a sharded dataset folder (`experts.json`); its N expert shard sets give
            `[N, B, 1025]` training batches. None: the prepared training shards, `[1, B, 1025]`.
        batch_size: training windows per expert per batch (B).
        eval_batch_size: windows per validation/test batch.
        shuffle_buffer: windows held per expert stream for shuffling.
        num_workers: DataLoader worker processes for the training stream.
        seed: seed of the training stream.
        verify: check shards against the manifest by `size` or by `sha256` before reading.
        expert_val_windows: windows per expert from its own expert-validation split, the held-out
            1% of its sequences that drives its learning-rate decay (without `experts_dir`: the
            prepared dataset's split, cut into windows). None: all of them (the paper); a cap,
            evenly spaced over the split, keeps CPU runs short.
        train_subset: the fraction of training windows read, chosen by a seeded key of each window
            (1: all; a seed run reads a subset of the corpus, App. D).
        auto_prepare: run `prepare` in `prepare_data()` when the dataset is missing or stale.
        test_split: what `test` and `predict` score, and what `test_set` (the windows of bootstrap
            reports) holds: `test`, the screened test split every development result reports, or
            `final`, the final test split (`test_final.npz`, prepared with
            `dataset.final_test_windows`), used once: only by the final runs of a reproduction.
    """

    def __init__(self, dataset: PrepareConfig = PrepareConfig(), experts_dir: str | None = None,
                 batch_size: int = 64, eval_batch_size: int = 64, shuffle_buffer: int = 1024,
                 num_workers: int = 0, seed: int = 0, verify: Verify = Verify.sha256, auto_prepare: bool = True,
                 expert_val_windows: int | None = None, prepared: str | None = None, recipe: str | None = None,
                 test_split: str = "test", train_subset: float = 1.0):
        super().__init__()
        if not 0 < train_subset <= 1:
            raise ConfigError(f"data.init_args.train_subset={train_subset} must be in (0, 1]")
        if test_split not in TEST_SPLITS:
            raise ConfigError(f"data.init_args.test_split={test_split} must be one of: {', '.join(TEST_SPLITS)}")
        for key, value, least in (("batch_size", batch_size, 1), ("eval_batch_size", eval_batch_size, 1),
                                  ("shuffle_buffer", shuffle_buffer, 1), ("num_workers", num_workers, 0)):
            if value < least:
                raise ConfigError(f"data.init_args.{key}={value} must be >= {least}")
        if expert_val_windows is not None and expert_val_windows < 1:
            raise ConfigError(f"data.expert_val_windows={expert_val_windows} must be >= 1 (or null: the whole split)")
        if recipe is not None and prepared is None:
            raise ConfigError("data.init_args.recipe needs data.init_args.prepared (the folder it builds)")
        if prepared is None:
            dataset.validate()
        elif dataset not in (PrepareConfig(), *([recipe_config(recipe, prepared)] if recipe else [])):
            # it would be ignored: the folder's manifest (or its recipe) says what it holds
            raise ConfigError(f"data.init_args.dataset is set but data.init_args.prepared={prepared} names the "
                              "dataset: give one of them (a recipe goes in data.init_args.recipe)")
        # One process per job prepares (global rank 0, on a shared file system); the others wait.
        self.prepare_data_per_node = False
        self.prepared = prepared
        self.recipe = recipe
        self.dataset = dataset
        self.experts_dir = experts_dir
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.shuffle_buffer = shuffle_buffer
        self.num_workers = num_workers
        self.seed = seed
        self.verify = Verify(verify)
        self.auto_prepare = auto_prepare
        self.expert_val_windows = expert_val_windows
        self.test_split = test_split
        self.train_subset = train_subset
        self.expert_val: list[torch.Tensor] | None = None
        """Each expert's expert-validation windows, `[n_e, 1025]` each."""
        self.shard_sets: list[list[Path]] = []
        self.val_set: EvalSet | None = None
        self.test_set: EvalSet | None = None
        self.fingerprints: dict[str, str | None] = {}
        """What `setup` read: `dataset` (the prepared folder's fingerprint) and `experts` (the
        sharding's); saved in checkpoints and checked when one is restored."""

    @property
    def root(self) -> Path:
        return Path(self.prepared if self.prepared is not None else self.dataset.output_dir).expanduser()

    def prepare_data(self) -> None:
        if not self.auto_prepare:
            return
        if self.prepared is None:
            prepare(self.dataset)
        elif self.recipe is not None:
            prepare_recipe(self.recipe, self.prepared, "data.init_args.prepared")

    def setup(self, stage: str | None = None) -> None:
        if self.prepared is None:
            manifest = read_manifest(self.root)
        else:
            manifest = open_prepared(self.prepared, "data.init_args.prepared")
        if self.experts_dir is None:
            if "expert_val" not in manifest:
                raise DataError(f"{self.root} was prepared without an expert-validation split (an older format): "
                                f"run prepare again (or set data.init_args.auto_prepare=true)")
            self.shard_sets = [verify_shards(self.root, _records(manifest["train"]), self.verify)]
            val_sets = [verify_shards(self.root, _records(manifest["expert_val"]), self.verify)]
            origin = self.root
        else:
            origin = Path(self.experts_dir).expanduser()
            sharded = read_experts_manifest(origin)
            self.fingerprints["experts"] = sharded.get("fingerprint")
            # Shards cut from another preparation of the corpus may hold this one's held-out documents.
            check_sharded_from(origin, sharded, self.root, manifest.get("fingerprint"))
            experts = expert_shards(origin, sharded)
            self.shard_sets = [verify_shards(origin, e.train, self.verify) for e in experts]
            val_sets = [verify_shards(origin, e.val, self.verify) for e in experts]
        if all(val_sets):
            self.expert_val = [fixed_windows(paths, self.expert_val_windows, self.joined) for paths in val_sets]
        else:
            warnings.warn(f"{origin}: some experts have no validation shards: no learning-rate decay", stacklevel=2)
        self.fingerprints["dataset"] = manifest.get("fingerprint")
        self.val_set = load_eval_set(self.root, manifest, "ensemble_val")
        self.test_set = self._load_test_set(manifest)

    def _load_test_set(self, manifest: dict) -> EvalSet:
        """The split `test_split` names; a dataset prepared without a final split is refused."""
        entry = manifest.get(TEST_SPLITS[self.test_split])
        if entry is None:
            raise DataError(f"data.init_args.test_split={self.test_split}: {self.root} has no final test split "
                            f"(test_final): prepare it again with dataset.final_test_windows > 0")
        return load_eval_set(self.root, manifest, TEST_SPLITS[self.test_split])

    def state_dict(self) -> dict:
        """Saved in every checkpoint: the fingerprints of the data it was trained on."""
        return {"fingerprints": dict(self.fingerprints)}

    def load_state_dict(self, state: dict) -> None:
        """Refuse a checkpoint trained on another prepared dataset or sharding (Lightning calls this
        after `setup` on `fit`, `validate`, `test` and `predict` with a checkpoint): its test windows
        were screened against other training documents, and a resumed run would read other data.

        Raises:
            DataError: a fingerprint recorded in the checkpoint differs from the data in use.
        """
        check_same_data("the checkpoint was trained on", state.get("fingerprints", {}), self.data_in_use())

    def data_in_use(self) -> dict[str, tuple[str | None, str]]:
        """What `setup` read, as `check_same_data` compares it: kind → (fingerprint, folder)."""
        folders = {"dataset": str(self.root), "experts": str(self.experts_dir)}
        return {kind: (fingerprint, folders[kind]) for kind, fingerprint in self.fingerprints.items()}

    @property
    def joined(self) -> bool:
        """Whether the shards hold documents to cut into windows (a prepared dataset) rather than
        windows (a sharded one)."""
        return self.experts_dir is None

    @property
    def num_experts(self) -> int:
        return len(self.shard_sets)

    def rank_layout(self) -> tuple[RankSplit, int, int]:
        """`(split, rank, world size)`: how this process shares the training data with the others.

        The LightningModule in training names the split (`rank_split`); without one, ranks read
        disjoint documents.
        """
        trainer = self.trainer
        if trainer is None or trainer.world_size == 1:
            return RankSplit.documents, 0, 1
        module = trainer.lightning_module
        split = RankSplit(module.rank_split) if isinstance(module, SplitsRanks) else RankSplit.documents
        return split, trainer.global_rank, trainer.world_size

    def expert_share(self) -> range:
        """The experts whose streams this rank reads (all of them unless expert-parallel)."""
        split, rank, world = self.rank_layout()
        if split is not RankSplit.experts:
            return range(self.num_experts)
        if world > self.num_experts:
            raise ConfigError(f"expert-parallel training of {self.num_experts} experts on {world} ranks: "
                              f"every rank needs at least one expert")
        return rank_share(self.num_experts, rank, world)

    def train_stream(self, skip_batches: int = 0) -> WindowStream:
        split, rank, world = self.rank_layout()
        if split is RankSplit.documents:
            return WindowStream(self.shard_sets, self.batch_size, self.seed, self.shuffle_buffer, rank, world,
                                skip_batches, joined=self.joined, subset=self.train_subset)
        # Replicated and expert-parallel ranks read whole streams, each what one process would read.
        share = self.expert_share()
        return WindowStream(self.shard_sets[share.start : share.stop], self.batch_size, self.seed,
                            self.shuffle_buffer, skip_batches=skip_batches, expert_ids=share, joined=self.joined,
                            subset=self.train_subset)

    def train_dataloader(self) -> DataLoader:
        # One batch per optimizer step: a resumed run skips the batches its restored steps consumed.
        skip = self.trainer.global_step if self.trainer else 0
        return DataLoader(self.train_stream(skip), batch_size=None, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """Ensemble validation (index 0, scored only), and each expert's own expert-validation
        windows (index 1, `([E, b, 1025], valid [E, b])`: the learning-rate decay signal)."""
        ensemble = self._eval_loader(self.val_set)
        if self.expert_val is None:
            return ensemble
        share = self.expert_share()
        windows = ExpertWindowsDataset(self.expert_val[share.start : share.stop], self.eval_batch_size)
        sampler = None
        if self.rank_layout()[0] is RankSplit.experts:
            # Each rank scores every batch of its own experts; a one-replica sampler keeps Lightning
            # from dealing the batches out across ranks.
            sampler = DistributedSampler(windows, num_replicas=1, rank=0, shuffle=False)
        return [ensemble, DataLoader(windows, batch_size=None, sampler=sampler)]

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        """`predict` scores the test windows (of `test_split`) one by one."""
        return self._eval_loader(self.test_set)

    def _eval_loader(self, evalset: EvalSet | None) -> DataLoader:
        if evalset is None:
            raise DataError("evaluation set not loaded: call setup() first")
        return DataLoader(EvalDataset(evalset), batch_size=self.eval_batch_size, shuffle=False)


def _records(entry: dict) -> list[ShardRecord]:
    return [ShardRecord(**r) for r in entry["shards"]]


class EvalDataset(torch.utils.data.Dataset):
    """A map-style view of an `EvalSet`: item i is `(window [1025] uint8, i)`.

    The index comes along so evaluation can attach per-window results to documents.
    """

    def __init__(self, evalset: EvalSet):
        self.windows = torch.from_numpy(np.ascontiguousarray(evalset.windows))

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.windows[index], index


class ExpertWindowsDataset(torch.utils.data.Dataset):
    """Every expert's own validation windows, padded to a common count.

    Item i is `(windows [E, b, 1025] uint8, valid [E, b] bool)`: batch i of each expert's windows,
    `valid` false on the padding of experts with fewer windows.
    """

    def __init__(self, windows: list[torch.Tensor], batch_size: int = 16):
        count = max(len(w) for w in windows)
        padded = torch.zeros(len(windows), count, WINDOW_BYTES, dtype=torch.uint8)
        valid = torch.zeros(len(windows), count, dtype=torch.bool)
        for expert, rows in enumerate(windows):
            padded[expert, : len(rows)] = rows
            valid[expert, : len(rows)] = True
        self.batches = list(zip(padded.split(batch_size, dim=1), valid.split(batch_size, dim=1), strict=False))

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[index]
