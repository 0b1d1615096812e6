"""tools/prepare_prose_prompts.py: prose paragraphs out of reStructuredText (no code, directives, titles or lists;
markup reduced to its text) and common dictionary words."""

from __future__ import annotations

from tool_utils import load_tool

RST = """Title
=====

The :class:`~email.policy.Policy` object controls how a message is parsed and generated, and an application
usually only specifies it once, when the :func:`parse <email.parse>` call creates the *message* (see the
`home page <https://python.org>`_ for more).

.. note::

   A directive body that must never become a prompt, even though it is long enough to pass the length rule.

Example::

   >>> a_literal_block_that_is_code = True

- a list item that is long enough to pass the length filter but is a list, and lists are not prose paragraphs.
"""


def test_doc_paragraphs_keep_prose_only(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "email.rst.txt").write_text(RST)
    paras = load_tool("prepare_prose_prompts").doc_paragraphs(tmp_path, min_chars=100)
    assert paras == ["The Policy object controls how a message is parsed and generated, and an application usually "
                     "only specifies it once, when the parse call creates the message (see the home page for more)."]


def test_common_words_are_single_vocab_tokens(tmp_path):
    index = tmp_path / "gcide.index"
    index.write_text("00-database-info\tA\tB\nApple\tC\tD\nzyzzyva\tE\tF\nice cream\tG\tH\ncat\tI\tJ\nrun\tK\tL\n")
    vocab = {"\u0120apple", "\u0120ice", "\u0120cat", "zyzzyva", "\u0120run"}
    assert load_tool("prepare_prose_prompts").common_words(index, vocab, min_len=3) == ["apple", "cat", "run"]
