"""Generate Tessera's built-in corpus, engine/data/assets/tessera_docs.jsonl.gz (and its SOURCE.md).

The text is English prose written for the Python standard library that the running CPython distribution
carries (PSF License), gathered without running any of it:

1. docstrings of modules, classes and functions in the pure-Python standard library (parsed with ``ast``),
2. docstrings of the built-in and compiled extension modules and of their classes and functions,
3. comment blocks (runs of consecutive ``#`` lines) in the pure-Python standard library,
4. the reference documentation bundled in ``pydoc_data/topics.py`` (plain-text renderings of the
   language and library reference, the text that ``help("if")`` shows),
5. the few documentation files shipped inside the library (email/architecture.rst, IDLE's help page and
   notes).

Test code (``test``/``tests``/``idle_test`` packages, ``test_*.py``), ``site-packages``, the
``_test*``/``xx*`` extension modules and the modules that the Python licence lists as carrying their own
licence terms (``LICENSED_ELSEWHERE``) are excluded. A text of at least ``MIN_CHARS`` characters is a
document of its own when it looks like English prose (few non-ASCII characters, mostly letters, common
English function words, not mostly capitals, code lines or doctests, no licence header) and is not a duplicate
(after normalizing whitespace and case) of an earlier one. Shorter prose texts (``MIN_NOTE_CHARS`` and
up) of one module are joined, in source order, into one "notes" document for that module. The documents
are sorted by source, then shuffled with a fixed seed so that a streaming reader sees a mix of topics,
and written one ``{"text": ...}`` JSON object per line into a gzip file with a zero timestamp: the
output is byte-identical on every run with the same Python build.

Usage: ``python scripts/make_corpus.py [--out engine/data/assets] [--stats]``
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import html.parser
import importlib
import inspect
import io
import json
import os
import platform
import random
import re
import sys
import sysconfig
import tokenize

MIN_CHARS = 200  # a text this long is a document of its own
MIN_NOTE_CHARS = 50  # shorter prose texts of one module are joined into that module's "notes" document
MIN_NOTE_WORDS = 8
GROUPED_KINDS = ("docstring", "comment", "cdoc")
SHUFFLE_SEED = 1234
OUT_NAME = "tessera_docs.jsonl.gz"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "data", "assets")

STDLIB = sysconfig.get_paths()["stdlib"]
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib-dynload"}
# Python code that LICENSE.txt / "Licenses and Acknowledgements for Incorporated Software" lists under
# its own (permissive, notice-preserving) terms: left out so that the corpus is PSF-licensed only.
LICENSED_ELSEWHERE = {"http/cookies.py", "trace.py", "uu.py", "xmlrpc/client.py", "xmlrpc/server.py"}
DOC_FILES = ["email/architecture.rst", "idlelib/extend.txt", "idlelib/HISTORY.txt"]
HELP_HTML = "idlelib/help.html"

STOPWORDS = frozenset(
    "the a an of to is and in for that it be this with as or are if by not on from can which when "
    "will an at all any its this these has have was were but".split()
)
_WORD = re.compile(r"[A-Za-z']+")
_CODE_LINE = re.compile(
    r"""^\s*(>>>|\.\.\.|[#$%]|def\s|class\s|import\s|from\s\S+\simport|return\b|raise\b|yield\b|
    elif\b|else:|try:|except\b|finally:|with\s.*:$|for\s.*:$|while\s.*:$|if\s.*:$|
    [\w.\[\]'"]+\s*[-+*/|&]?=\s*\S|[\w.]+\(.*\)\s*$|[{}\[\]()<>]+\s*$)""",
    re.VERBOSE,
)


# ------------------------------------------------------------------------------------------------------
# Filters
# ------------------------------------------------------------------------------------------------------


def clean(text: str) -> str:
    """Strip trailing spaces, form feeds and runs of blank lines; keep the author's line breaks."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\x0c", "").split("\n")]
    out = "\n".join(lines).strip("\n")
    out = re.sub(r"\n{3,}", "\n\n", out)
    return out.strip()


def prose_reason(text: str, min_chars: int = MIN_CHARS, min_words: int = 30) -> str | None:
    """None if ``text`` looks like English prose, else why not (for --stats)."""
    if len(text) < min_chars:
        return "short"
    non_ascii = sum(1 for c in text if ord(c) > 127)
    if non_ascii > 0.02 * len(text):
        return "non-ascii"
    visible = [c for c in text if not c.isspace()]
    letters = sum(1 for c in visible if c.isalpha())
    if letters < 0.62 * len(visible):
        return "symbols"
    if sum(1 for c in visible if c.isupper()) > 0.3 * letters:
        return "uppercase"  # character-name tables of the codecs, constant lists
    words = _WORD.findall(text.lower())
    if len(words) < min_words or sum(1 for w in words if w in STOPWORDS) < 0.10 * len(words):
        return "not-english"
    lines = [line for line in text.split("\n") if line.strip()]
    code = sum(1 for line in lines if _CODE_LINE.match(line))
    if code > 0.5 * len(lines):
        return "code"
    head = text.lower()[:400]
    if "copyright" in head or "license" in head:
        return "licence"
    return None


# ------------------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------------------


def stdlib_py_files() -> list[str]:
    """Paths (relative to the stdlib folder, sorted) of the non-test pure-Python modules."""
    files = []
    for dirpath, dirnames, filenames in os.walk(STDLIB):
        rel = os.path.relpath(dirpath, STDLIB)
        parts = [] if rel == "." else rel.split(os.sep)
        if any(p in EXCLUDED_DIRS or p.startswith("config-") for p in parts):
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-"))
        for name in filenames:
            path = os.path.normpath(os.path.join(rel, name)).replace(os.sep, "/")
            if name.endswith(".py") and not name.startswith("test_") and name != "topics.py" and path not in LICENSED_ELSEWHERE:
                files.append(path)
    return sorted(files)


def _decode(data: bytes) -> str:
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)


def py_docstrings(rel: str, source: str):
    """Module, class and function docstrings, in line order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield "docstring", rel, getattr(node, "lineno", 0), doc


def py_comment_blocks(rel: str, source: str):
    """Runs of comments on consecutive lines, without their "# " markers."""
    block: list[str] = []
    start = last = -10
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            line = tok.start[0]
            body = tok.string[1:]
            if body.startswith("!") or (line <= 2 and "coding" in body[:20]):
                continue  # shebang and encoding lines
            if line != last + 1 and block:
                yield "comment", rel, start, "\n".join(block)
                block = []
            if not block:
                start = line
            block.append(body[1:] if body.startswith(" ") else body.lstrip("#").strip())
            last = line
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    if block:
        yield "comment", rel, start, "\n".join(block)


def extension_module_names() -> list[str]:
    names = set(sys.builtin_module_names)
    dynload = os.path.join(STDLIB, "lib-dynload")
    if os.path.isdir(dynload):
        for name in os.listdir(dynload):
            names.add(name.split(".")[0])
    skip = ("_test", "xx", "_xx", "_ctypes_test")
    return sorted(n for n in names if not n.startswith(skip))


def c_docstrings():
    """Docstrings of built-in/extension modules, their classes and functions (module-defined objects only)."""
    for name in extension_module_names():
        try:
            mod = importlib.import_module(name)
        except Exception:  # not built on this platform, or needs a display
            continue
        if getattr(mod, "__file__", "") and not str(mod.__file__).endswith((".so", ".pyd")) and name not in sys.builtin_module_names:
            continue
        yield "cdoc", name, 0, inspect.getdoc(mod) or ""
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr, None)
            if attr.startswith("__") or getattr(obj, "__module__", name) not in (name, name.lstrip("_"), "builtins"):
                continue
            if inspect.isclass(obj) or inspect.isroutine(obj):
                yield "cdoc", name, 0, obj.__doc__ or ""
            if inspect.isclass(obj):
                for member in sorted(vars(obj)):
                    value = vars(obj)[member]
                    if (member.startswith("__") and member != "__init__") or not (
                        inspect.isroutine(value) or inspect.ismethoddescriptor(value) or inspect.isdatadescriptor(value)
                    ):
                        continue
                    yield "cdoc", name, 0, getattr(value, "__doc__", None) or ""


def pydoc_topics():
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    for key in sorted(topics):
        yield "topic", key, 0, topics[key]


class _HelpText(html.parser.HTMLParser):
    """Text of the main body of a Sphinx HTML page, split at <h2> headings."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.sections: list[list[str]] = [[]]
        self.depth = 0  # >0 inside <div class="body">
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if self.depth:
            if tag == "div":
                self.depth += 1
            if tag == "h2":
                self.sections.append([])
            if tag in ("p", "li", "dt", "dd", "h1", "h2", "h3", "pre", "tr", "div", "section"):
                self.sections[-1].append("\n\n")
            if tag == "a" and "headerlink" in (attrs.get("class") or ""):
                self.skip += 1
        elif tag == "div" and attrs.get("class") == "body":
            self.depth = 1

    def handle_endtag(self, tag):
        if self.depth:
            if tag == "div":
                self.depth -= 1
            if tag == "a" and self.skip:
                self.skip -= 1

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.sections[-1].append(data)


def doc_files():
    for rel in DOC_FILES:
        path = os.path.join(STDLIB, rel)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                yield "file", rel, 0, f.read()
    path = os.path.join(STDLIB, HELP_HTML)
    if os.path.isfile(path):
        parser = _HelpText()
        with open(path, encoding="utf-8") as f:
            parser.feed(f.read())
        for i, section in enumerate(parser.sections):
            text = re.sub(r"[ \t]*\n[ \t]*", "\n", "".join(section))
            text = re.sub(r"(?<!\n)\n(?!\n)", " ", text)  # unwrap lines inside paragraphs
            yield "file", f"{HELP_HTML}#{i}", 0, text


def all_texts():
    """(source id, raw text) pairs in a fixed order."""
    files = stdlib_py_files()
    sources = {}
    for rel in files:
        with open(os.path.join(STDLIB, rel), "rb") as f:
            try:
                sources[rel] = _decode(f.read())
            except (SyntaxError, UnicodeDecodeError, LookupError):
                continue
    for rel in files:
        if rel in sources:
            yield from py_docstrings(rel, sources[rel])
    yield from c_docstrings()
    yield from pydoc_topics()
    yield from doc_files()
    for rel in files:
        if rel in sources:
            yield from py_comment_blocks(rel, sources[rel])


def build_documents(stats: bool = False) -> tuple[list[str], int]:
    """The corpus (long texts one document each, plus one "notes" document per module of its short texts)
    and how many of its documents are notes."""
    docs, seen = [], set()
    notes: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
    kept: dict[str, list[int]] = {}
    dropped: dict[str, int] = {}

    def keep(kind: str, text: str) -> None:
        docs.append(text)
        kept.setdefault(kind, [0, 0])
        kept[kind][0] += 1
        kept[kind][1] += len(text)

    for seq, (kind, unit, pos, raw) in enumerate(all_texts()):
        if not isinstance(raw, str):
            continue
        text = clean(raw)
        reason = prose_reason(text)
        short = reason == "short" and kind in GROUPED_KINDS
        if short:
            reason = prose_reason(text, min_chars=MIN_NOTE_CHARS, min_words=MIN_NOTE_WORDS)
        if reason is None:
            key = " ".join(text.lower().split())
            if key in seen:
                reason = "duplicate"
            else:
                seen.add(key)
                if short:
                    notes.setdefault((kind if kind == "cdoc" else "py", unit), []).append((pos, seq, text))
                else:
                    keep(kind, text)
        if reason is not None:
            dropped[f"{kind}:{reason}"] = dropped.get(f"{kind}:{reason}", 0) + 1
    for (kind, unit), pieces in sorted(notes.items()):
        text = "\n\n".join(piece for _, _, piece in sorted(pieces))
        if len(text) >= MIN_CHARS:
            keep(f"notes-{kind}", text)
        else:
            dropped[f"notes-{kind}:short"] = dropped.get(f"notes-{kind}:short", 0) + 1
    if stats:
        for kind, (n, chars) in sorted(kept.items()):
            print(f"kept {kind:12s} {n:6d} docs {chars:10,d} chars", file=sys.stderr)
        for key, n in sorted(dropped.items()):
            print(f"dropped {key:24s} {n:6d}", file=sys.stderr)
    random.Random(SHUFFLE_SEED).shuffle(docs)
    num_notes = sum(n for kind, (n, _) in kept.items() if kind.startswith("notes-"))
    return docs, num_notes


def write_jsonl_gz(docs: list[str], path: str) -> None:
    payload = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    tmp = path + ".tmp"
    with open(tmp, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
            gz.write(payload)
    os.replace(tmp, path)


SOURCE_MD = """\
# Where Tessera's built-in data comes from

## tessera_docs.jsonl.gz (the `tessera_docs` dataset)

English prose written for the **Python standard library of CPython {version}** ({impl}, the distribution
that ran `scripts/make_corpus.py`), gathered without executing any of it:

1. docstrings of the modules, classes and functions of the pure-Python standard library (parsed with `ast`);
2. docstrings of the built-in and compiled extension modules (`sys`, `math`, `_io`, ...), their classes
   and functions;
3. the reference documentation bundled with the standard library in `pydoc_data/topics.py` (the plain-text
   renderings of the language and library reference that `help()` shows);
4. the documentation files shipped inside the library: `email/architecture.rst`, IDLE's `help.html`,
   `extend.txt` and `HISTORY.txt`;
5. comment blocks (consecutive `#` lines) of the pure-Python standard library.

Left out: test code (`test`, `tests`, `idle_test` packages and `test_*.py`), `site-packages`, the
`_test*`/`xx*` extension modules, and the modules that Python's licence documentation lists under
their own terms ({elsewhere}). A text of at least {min_chars} characters is a document of its own when
it looks like English prose (few non-ASCII characters, mostly letters, common English function words,
not mostly capitals, code or doctest lines, no licence header) and is not a duplicate of an earlier one; shorter
prose texts (from {min_note_chars} characters) of one module are joined, in source order and separated
by blank lines, into one "notes" document for that module. The documents are shuffled with a fixed seed.
One JSON object `{{"text": ...}}` per line, gzip-compressed.

- documents: {num_docs:,} ({num_notes:,} of them per-module notes)
- text: {chars:,} characters ({utf8_bytes:,} bytes of UTF-8)
- file: {gz_bytes:,} bytes, sha256 `{sha256}`

### Licence

The Python standard library, its docstrings, comments and documentation are distributed under the
**PSF License Agreement** (PSF-2.0), reproduced below from the `LICENSE.txt` of the Python distribution
(also at https://docs.python.org/3/license.html). It permits reproducing, preparing derivative works of
and distributing Python alone or in any derivative version, provided the licence agreement and the PSF
copyright notice are retained (they are, below) and a brief summary of the changes is included. The
shipped file is a derivative work (an extract) of Python {version}; summary of the changes: the texts
listed above were extracted from the library, whitespace-normalized, filtered (length, English prose,
duplicates) and reordered as described above; short texts of a module were joined; nothing was
rewritten.

```
{psf_license}
```

## tokenizer.json, tokenizer_config.json

A byte-level BPE tokenizer (vocabulary 4096 including the special tokens `<|begin_of_text|>`,
`<|end_of_text|>`, `<|pad|>`) trained by `scripts/make_tokenizer.py` with the `tokenizers` library on
`tessera_docs.jsonl.gz` above; it is derived from that text and carries no other data.

Regenerate both, deterministically (byte-identical with the same Python build and `tokenizers` version):

    python scripts/make_corpus.py
    python scripts/make_tokenizer.py
"""


def psf_license_text() -> str:
    """The PSF License Agreement section of the distribution's LICENSE.txt."""
    with open(os.path.join(STDLIB, "LICENSE.txt"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2")
    end = text.index("BEOPEN.COM LICENSE AGREEMENT", start)
    return text[start:end].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: engine/data/assets)")
    parser.add_argument("--stats", action="store_true", help="print what was kept and dropped")
    args = parser.parse_args(argv)
    docs, num_notes = build_documents(stats=args.stats)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, OUT_NAME)
    write_jsonl_gz(docs, path)
    with open(path, "rb") as f:
        data = f.read()
    chars = sum(len(d) for d in docs)
    utf8_bytes = sum(len(d.encode("utf-8")) for d in docs)
    with open(os.path.join(args.out, "SOURCE.md"), "w", encoding="utf-8") as f:
        f.write(
            SOURCE_MD.format(
                version=platform.python_version(),
                impl=f"{platform.python_implementation()} {platform.python_version()} on {sys.platform}",
                min_chars=MIN_CHARS,
                min_note_chars=MIN_NOTE_CHARS,
                num_notes=num_notes,
                elsewhere=", ".join(f"`{p}`" for p in sorted(LICENSED_ELSEWHERE)),
                psf_license=psf_license_text(),
                num_docs=len(docs),
                chars=chars,
                utf8_bytes=utf8_bytes,
                gz_bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            )
        )
    print(f"wrote {path}: {len(docs):,} documents, {chars:,} characters, {len(data):,} bytes compressed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
