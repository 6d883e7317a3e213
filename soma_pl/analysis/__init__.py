"""analysis: measurements behind the paper's figures (`python -m soma_pl.cli analyze ...`).

- `variance`: relative SPSA gradient error at fixed weights against N, n_pert, batch size and loss
  grouping, with closed-form predictions (Figs. 10 and 11).
- `topk`: ensemble-validation loss for every top-k from one pass (Fig. 16).
- `error_correlation`: pairwise error similarity against the gain of averaging a pair (Fig. 17).
- `runs`: several fits' `summary.json` side by side, one table (`python -m soma_pl.cli runs`);
  `curves` draws their validation loss against updates, multiply-adds and update time.
"""
