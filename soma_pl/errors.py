"""Errors that end a command with one clear line and a non-zero exit (see `soma_pl.cli`)."""


class SomaError(Exception):
    """Bad input a user can fix: the message is one line naming the file, key or shape at fault."""


class DataError(SomaError):
    """A missing, empty or corrupt corpus, shard or prepared dataset."""


class ConfigError(SomaError):
    """A configuration that cannot work (unknown source, mismatched shapes, ...)."""


class SettingError(ConfigError, ValueError):
    """One setting outside its range: `<key>=<value> must be <rule>` (a `ValueError` too, for code
    that builds a settings object directly)."""


def require(ok: bool, key: str, value, rule: str) -> None:
    """Raise `SettingError("<key>=<value> must be <rule>")` unless `ok`."""
    if not ok:
        raise SettingError(f"{key}={value} must be {rule}")
