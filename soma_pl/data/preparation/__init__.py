"""`prepare`: a corpus turned into a prepared dataset folder; imports `corpus`, `formats`, `runner`.

- `config`: `PrepareConfig`, what is built and where (the `dataset:` section of a data config).
- `heldout`: which documents are held out (seeded hashes), the overlap screen, the expert-validation choice.
- `steps`: the four datatrove stages (select, plan, write, finish).
- `prepare`: `prepare()`, building a folder (or finding it up to date), and data-config recipes.
- `command`: the `prepare` command.
"""
