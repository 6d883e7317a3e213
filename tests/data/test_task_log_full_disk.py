"""A task's log file on a full disk drops its lines quietly: the command's own write error is its one
line, not preceded by loguru's `Logging error` traceback for every log line."""

from __future__ import annotations

import errno

from soma_pl.data.runner import pipeline


class FullDisk:
    """A log file on a disk with no room left."""

    def __init__(self):
        self.closed = False

    def write(self, message: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    flush = write

    def close(self) -> None:
        self.closed = True
        raise OSError(errno.ENOSPC, "No space left on device")


class Folder:
    def open(self, path: str, mode: str) -> FullDisk:
        return FullDisk()


def test_log_lines_onto_a_full_disk_are_dropped_without_a_word(capfd):
    from loguru import logger

    logfile = pipeline._task_logger(Folder(), rank=0)
    logger.info("a task's progress")
    logger.warning("a warning still reaches the console")
    pipeline._close_task_logger(logfile)
    err = capfd.readouterr().err
    assert logfile.closed and "Logging error" not in err and "No space" not in err, err
    assert "a warning still reaches the console" in err


def test_a_python_log_line_onto_a_full_disk_is_dropped_without_a_traceback(capfd, monkeypatch):
    """Lightning logs through Python's logging: a command whose output goes to a full disk (a sweep
    trial's fit.log) drops the line instead of printing logging's `--- Logging error ---` traceback."""
    import logging

    import pytest

    from soma_pl.cli import main

    monkeypatch.setattr(logging, "raiseExceptions", True)  # Python's default, restored after the test
    with pytest.raises(SystemExit):
        main(["--help"])
    log = logging.getLogger("lightning.pytorch.full_disk_probe")
    class FullStream(FullDisk):
        def flush(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    handler = logging.StreamHandler(FullStream())
    log.addHandler(handler)
    try:
        log.warning("a line for a full disk")
    finally:
        log.removeHandler(handler)
    assert "Logging error" not in capfd.readouterr().err
