"""What `prepare` and `shard` write and training reads, on disk; imports only `corpus`.

- `tar_shards`: WebDataset tar shards of documents, their records and verification.
- `evalsets`: fixed evaluation windows (`EvalSet`, one `.npz` each).
- `manifest`: the prepared dataset folder's `manifest.json`: its format, reading and checking it.
- `expert_sets`: the sharded dataset folder: per-expert shard sets listed in `experts.json`, the router file.
"""
