"""Optuna sweeps: sweep files (`space`), the shared study and its queue (`study`), a worker
(`runner`, `python -m soma_pl.cli sweep`), one trial's process (`trial`) and the Table 6 / Table 7
tables (`report`, `python -m soma_pl.cli sweep report`)."""
