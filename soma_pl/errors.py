"""Errors that end a command with one clear line and a non-zero exit (see `soma_pl.cli`)."""


class SomaError(Exception):
    """Bad input a user can fix: the message is one line naming the file, key or shape at fault."""


class DataError(SomaError):
    """A missing, empty or corrupt corpus, shard or prepared dataset."""


class ConfigError(SomaError):
    """A configuration that cannot work (unknown source, mismatched shapes, ...)."""
