"""The native kernel's first build is announced with one line naming its cache; a cached one is not."""

from __future__ import annotations

import pytest
import torch.utils.cpp_extension

from soma_pl.models import recurrence


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    built = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(recurrence.KERNEL_ENV, raising=False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: built.append(kwargs) or "module")
    recurrence.grouped_extension.cache_clear()
    yield built
    recurrence.grouped_extension.cache_clear()  # later tests load the real kernel


def test_a_build_says_so_once_and_where_it_is_cached(fresh_cache, tmp_path, capsys):
    assert recurrence.grouped_extension() == "module"
    lines = capsys.readouterr().err.splitlines()
    folder = fresh_cache[0]["build_directory"]
    assert len(lines) == 1 and "building" in lines[0] and folder in lines[0] and folder.startswith(str(tmp_path))
    (tmp_path / folder / f"{fresh_cache[0]['name']}.so").write_bytes(b"")  # what the build left
    recurrence.grouped_extension.cache_clear()
    assert recurrence.grouped_extension() == "module" and capsys.readouterr().err == ""
