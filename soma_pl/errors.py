"""Errors that end a command with one clear line and a non-zero exit (see `soma_pl.cli`)."""

import signal


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


class Interrupted(BaseException):
    """A signal (SIGINT, SIGTERM) stopped the command: it ends with `soma_pl: interrupted` and exit
    status 128 + the signal's number (130, 143), as a shell reports a process the signal ended. A
    `BaseException`, as `KeyboardInterrupt` is, so that no `except Exception` takes it for a failure."""

    def __init__(self, signum: int, detail: str | None = None):
        self.signal = signal.Signals(signum)
        self.detail = detail
        """What the command left (where the state it saved is), or None."""
        super().__init__(self.signal.name if detail is None else f"{self.signal.name}: {detail}")
