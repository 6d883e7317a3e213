"""bench: measurements written as JSON (`python -m soma_pl.cli bench ...`), ratios taken side by side
in one run, never timed assertions.

- `zo`: zero-order update throughput, batched SPSA/EGGROLL against inference and a naive loop.
- `kernels`: our LSTM stack against `torch.nn.LSTM` with the same weights.
- `inference`, `memory`: Table 12's throughput, latency and memory; memory against context.
- `data`, `prepare`: training-stream throughput; `prepare` MB/s and peak RSS at 1 and N tasks.
"""
