"""`python -m soma_pl.cli reproduce <experiment>`: the paper's experiments, one command each."""
