"""Prompt text (``prompts.py``): Project Gutenberg headers and footers, old and new, carriage returns, questions
about a document (``--prompt-file`` with ``--prompt``), ``max_prompt_tokens`` cutting the document and not the question,
and a follow-up question reusing the document's KV cache."""

import json
import os
import subprocess
import sys

import pytest

from triforce import SamplingParams, TriForce
from triforce.text.prompts import strip_gutenberg

GREEDY = SamplingParams(temperature=0)


def run(*args, env=None, stdin=None):
    """The CLI in a subprocess: (exit status, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "triforce", *args], capture_output=True, text=True, timeout=300,
                          env=env, input=stdin)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def tf(tiny_folder):
    return TriForce.load(tiny_folder)


def test_question_about_a_document_from_the_command_line(tiny_folder, tf, tmp_path):
    doc = "*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\nIt is a truth universally acknowledged.\r\n" \
          "*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nlicence"
    f = tmp_path / "book.txt"
    f.write_bytes(doc.encode())
    code, out, err = run("generate", "--model", tiny_folder, "--prompt-file", str(f), "--prompt", "Who?", "--chat",
                         "--max-new-tokens", "2", "--json", "--threads", "1")
    assert code == 0, err
    expect = tf.tokenizer.apply_chat_template(
        [{"role": "user", "content": "It is a truth universally acknowledged.\n\nWho?"}], add_generation_prompt=True,
        tokenize=True)
    expect = expect["input_ids"] if hasattr(expect, "keys") else expect
    assert json.loads(out)["prompt_tokens"] == len(expect) == len("<user>It is a truth universally acknowledged.") + 1 \
        + len("Who?<assistant>")  # the char tokenizer: one token per character, "\n\n" one unknown token


def test_max_prompt_tokens_cuts_the_document_not_the_question(tf):
    ids = tf.encode("Who is he?", chat=True, document="abcdefghij" * 20, max_prompt_tokens=40)
    overhead = len("<user>") + 1 + len("Who is he?<assistant>")  # "\n\n" is one token
    kept = ("abcdefghij" * 20)[:40 - overhead]  # 12 characters of the document
    expect = tf.encode(kept + "\n\nWho is he?", chat=True)
    assert ids == expect and len(ids) == 40
    with pytest.raises(ValueError, match="max_prompt_tokens=10 leaves no room for the document"):
        tf.encode("Who is he?", chat=True, document="abc" * 50, max_prompt_tokens=10)


def test_follow_up_question_reuses_the_documents_kv_cache(tiny_folder):
    tf = TriForce.load(tiny_folder)
    doc = "the quick brown fox jumps over the lazy dog. " * 6
    first = tf.encode("Who jumps?", chat=True, document=doc)
    second = tf.encode("Who is lazy?", chat=True, document=doc)
    tf.generate(first, max_new_tokens=4, sampling=GREEDY)
    r = tf.generate(second, max_new_tokens=4, sampling=GREEDY)
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert common >= len(doc)  # the whole document is shared
    assert r.stats.tiers["target"]["reused_prefix_tokens"] == common


OLD_BOOK = """The Project Gutenberg Etext of Some Book, by Some One\r
Copyright laws are changing all over the world\r
**Welcome To The World of Free Plain Vanilla Electronic Texts**\r
\r
***START**THE SMALL PRINT!**FOR PUBLIC DOMAIN ETEXTS**START***\r
Why is this "Small Print!" statement here?  You know: lawyers.\r
*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\r
\r
\r
CHAPTER I\r
\r
It was a dark and stormy night.\r
\r
End of this Project Gutenberg Etext of Some Book, by Some One\r
"""


def test_old_gutenberg_header_and_footer_are_stripped():
    assert strip_gutenberg(OLD_BOOK) == "CHAPTER I\n\nIt was a dark and stormy night."
    new = "h\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nbody\n\nEnd of the Project Gutenberg EBook of X\n\n" \
          "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicence"
    assert strip_gutenberg(new) == "body"
    assert strip_gutenberg("plain\r\ntext\rhere") == "plain\ntext\nhere"  # no markers: only line endings


def test_real_books_lose_their_licence_and_carriage_returns():
    books = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "books")
    path = os.path.join(books, "pg1342.txt")
    if not os.path.isfile(path):
        pytest.skip(f"books folder absent ({books})")
    raw = open(path, encoding="utf-8").read()
    assert "\r" in open(path, "rb").read().decode("utf-8")  # the file itself has \r\n line endings
    text = strip_gutenberg(raw)
    assert "\r" not in text and "Project Gutenberg" not in text[-2000:] and "Gutenberg" not in text[:300]
    assert text.endswith("uniting them.")


def test_prompt_file_with_crlf_and_old_markers(tiny_folder, tmp_path):
    f = tmp_path / "old.txt"
    f.write_bytes(OLD_BOOK.encode())
    code, out, err = run("generate", "--model", tiny_folder, "--prompt-file", str(f), "--max-new-tokens", "1",
                         "--json", "--threads", "1")
    assert code == 0, err
    # "CHAPTER I", "\n\n" (one unknown token for the run of newlines), then the sentence
    assert json.loads(out)["prompt_tokens"] == len("CHAPTER I") + 1 + len("It was a dark and stormy night.")
