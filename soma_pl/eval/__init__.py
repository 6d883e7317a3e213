"""eval: how a model is scored, below every module that scores one (Table 1's protocol).

- `metrics`: nats/byte metrics reduced correctly across processes (`NatsPerByte`, `PerExpertNats`).
- `ensemble`: route each window on its first 256 bytes, score the next 768, top-k probability averaging.
- `bootstrap`: document-level bootstrap intervals of a mean loss.
- `checks`: what every scoring command refuses (counts below one, non-finite losses).

The `evaluate` command (external text, Table 9) lives above the LightningModules, in `soma_pl.evaluate_text`.
"""
