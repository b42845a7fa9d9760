"""Real text available offline, for long-document workloads.

Source: the Python standard library's own documentation, rendered by
``pydoc`` from the interpreter that runs this (no download, no data
package). Each module's reference page is one document; documents are cut
to an exact token count for a given tokenizer.
"""

from __future__ import annotations

import pydoc
from collections.abc import Iterator
from typing import Any

MODULES = (
    "json", "argparse", "collections", "pathlib", "datetime", "logging", "threading", "subprocess",
    "csv", "sqlite3", "decimal", "statistics", "textwrap", "string", "random", "itertools",
    "functools", "heapq", "shutil", "tarfile", "zipfile", "socket", "selectors", "asyncio",
    "unittest", "email", "http.client", "urllib.parse", "xml.etree.ElementTree", "configparser",
)

QUESTIONS = (
    "What is this document about? Answer in one sentence.",
    "List three functions or classes that the document describes.",
    "Which part of the document would a beginner read first, and why?",
)


def module_texts() -> Iterator[tuple[str, str]]:
    for name in MODULES:
        try:
            yield name, pydoc.render_doc(name, renderer=pydoc.plaintext)
        except (ImportError, pydoc.ErrorDuringImport):
            continue


def documents(tokenizer: Any, count: int, tokens_each: int) -> list[tuple[str, str]]:
    """``count`` documents of about ``tokens_each`` tokens: (source, text).

    Short pages are joined with the next ones, so every document reaches the
    length. Raises ValueError when the library has too little text.
    """
    out: list[tuple[str, str]] = []
    names: list[str] = []
    ids: list[int] = []
    for name, text in module_texts():
        names.append(name)
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) >= tokens_each:
            out.append(("pydoc:" + "+".join(names), tokenizer.decode(ids[:tokens_each])))
            names, ids = [], []
            if len(out) == count:
                return out
    raise ValueError(f"only {len(out)} documents of {tokens_each} tokens available, {count} asked")
