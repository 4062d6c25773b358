"""The books the research tools read: where they are, finding one by name, its first N tokens.

The books folder, for ``triforce bench`` and ``triforce analyze`` alike: ``shared/data/books`` beside the repository
(``$TRIFORCE_BOOKS`` overrides it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..text.prompts import strip_gutenberg

#: the books folder: ``$TRIFORCE_BOOKS``, else ``../shared/data/books`` next to the repository root
BOOKS_DIR = Path(os.environ.get("TRIFORCE_BOOKS") or Path(__file__).resolve().parents[3] / ".." / "shared" / "data"
                 / "books")


def resolve_book(name: str, books_dir: str | os.PathLike = BOOKS_DIR) -> Path:
    """The file of a book given as a path, or as a name in ``books_dir`` (``pg1342`` or ``pg1342.txt``).

    Raises:
        FileNotFoundError: neither ``name`` nor ``books_dir/name[.txt]`` is a file (the places tried are in the
            message).
    """
    tried = [Path(name), Path(books_dir) / name, Path(books_dir) / f"{name}.txt"]
    for p in tried:
        if p.is_file():
            return p
    raise FileNotFoundError(f"book {name!r} not found (tried {', '.join(str(p) for p in tried)})")


def book_prompt(tokenizer: Any, path: str | os.PathLike, n: int) -> list[int]:
    """The first ``n`` tokens of a book, Project Gutenberg header and footer removed, no chat template.

    Tokenizes a character prefix of the text (doubling it until it yields at least n + 64 tokens), so only the
    tokens near the cut could differ from tokenizing the whole book, and those are dropped.

    Args:
        tokenizer: a transformers tokenizer.
        path: the book's text file (UTF-8; undecodable bytes replaced).
        n: tokens wanted (>= 1).

    Returns:
        list of ``n`` int token ids (with the tokenizer's special tokens at the start, if it adds any).

    Raises:
        ValueError: the book has fewer than ``n`` tokens (its name and token count are in the message).
    """
    text = strip_gutenberg(Path(path).read_text(encoding="utf-8", errors="replace"))
    chars = 8 * n
    while True:
        ids = tokenizer(text[:chars], verbose=False)["input_ids"]
        if len(ids) >= n + 64 or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise ValueError(f"{Path(path).name} has only {len(ids)} tokens after stripping, fewer than {n}")
    return [int(t) for t in ids[:n]]

