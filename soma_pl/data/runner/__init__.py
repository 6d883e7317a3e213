"""How `prepare` and `shard` run as datatrove pipelines; imports only `corpus` and `formats`.

- `executor`: `ExecutorConfig`, how a pipeline runs (local, Slurm, Ray), without importing datatrove.
- `pipeline`: the executors built from it, chained stages, task logs, the corpus reader steps.
- `staging`: the staging folder of a build, running a chain of stages there.
- `task_files`: what a stage's tasks write for the next (atomic `.npz`/`.npy`), hard links into the
  output, a task's peak memory.
"""
