"""`shard`: a prepared dataset cut into N expert shard sets with a router; imports the stages below it.

- `config`: `ShardConfig`, what is built and where.
- `assign`: 1,024-byte sequences, the router's fit (tf–idf, SVD, balanced k-means), the deal and
  each expert's held-out share.
- `steps`: the five datatrove stages (sequences, fit, assign, write, finish).
- `shard`: `shard()`, building a folder (or finding it up to date).
- `command`: the `shard` command.
"""
