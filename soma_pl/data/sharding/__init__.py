"""`shard`: a prepared dataset cut into N expert shard sets with a router; imports the stages below it.

- `config`: `ShardConfig`, what is built and where, and the embedder of the first 256 bytes.
- `assign`: which expert each document goes to (k-means with rebalancing, or a seeded deal).
- `steps`: the four datatrove stages (embed, fit, write, finish).
- `shard`: `shard()`, building a folder (or finding it up to date).
- `command`: the `shard` command.
"""
