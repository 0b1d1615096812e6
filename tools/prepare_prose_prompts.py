"""Prose prompts for the bundled drafter's data: passages of the Python documentation and common English words.

The drafter accepts least on prose (docs/training.md: a "why is the sky blue" answer accepts 1 draft in 5). ShareGPT
is the only chat source here and it is used up, so this adds two more, both from Debian packages (RESOURCES.md):
  - paragraphs of the Python documentation's reStructuredText sources (python3.11-doc), each with a request to
    explain, summarize, rewrite or quiz on it: technical prose like the explanations after a code answer;
  - common English words from the GCIDE dictionary's index (dict-gcide; "common" = one token of the target's
    vocabulary with a leading space), each in a writing request (define, use in sentences, a short story, an email).
Evaluation prompts and duplicates are dropped. Usage (no install needed, the packages are only unpacked):
  apt-get download python3.11-doc dict-gcide && dpkg -x python3.11-doc_*.deb d && dpkg -x dict-gcide_*.deb d
  python tools/prepare_prose_prompts.py out.jsonl --docs d/usr/share/doc/python3.11/html/_sources \\
      --dictionary d/usr/share/dictd/gcide.index [--num-docs N] [--num-words N] [--seed S]"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

from blockspec.data.exclusion import write_training_prompts

DOC_REQUESTS = (
    "Explain this passage from the Python documentation in simpler words:\n\n{}",
    "Summarize the following text in two or three sentences:\n\n{}",
    "Rewrite this paragraph for a beginner programmer:\n\n{}",
    "Write three questions a student might ask about this text, and answer them:\n\n{}",
    "What are the key points of this passage?\n\n{}",
)
WORD_REQUESTS = (
    "What does the word \"{}\" mean? Give a short definition and two example sentences.",
    "Write a short paragraph of three or four sentences that uses the word \"{}\".",
    "Write a very short story (under 150 words) about {}.",
    "Explain the idea of \"{}\" to a ten-year-old.",
    "Write a short, friendly email to a colleague that mentions {}.",
    "Give me three interesting facts related to {}.",
)
_LINK = re.compile(r"\s*<[^<>]*>`_+")  # `text <url>`_ -> `text`
_MARKUP = re.compile(r":[a-z:]+:`([^`<]*)(?:<[^`]*>)?`|`+_*|\*+|\|")


def _role_text(m: re.Match) -> str:
    """Sphinx roles show their text: `~a.b.C` shows as C, `!x` as x, `text <target>` as text."""
    text = (m.group(1) or "").strip()
    if text.startswith("~"):
        return text[1:].rsplit(".", 1)[-1]
    return text.lstrip("!")


def doc_paragraphs(root: Path, min_chars: int = 250, max_chars: int = 1200) -> list[str]:
    """Plain prose paragraphs: no directives, literal blocks, tables, titles or lists; roles reduced to their text."""
    out: list[str] = []
    for f in sorted(root.rglob("*.rst.txt")):
        text = f.read_text(encoding="utf-8", errors="replace")
        for block in re.split(r"\n\s*\n", text):
            lines = block.splitlines()
            if not lines or any(line.startswith((" ", "\t", "..", "*", "-", "=", "+", "|", ">>>")) for line in lines):
                continue
            if block.rstrip().endswith("::") or re.fullmatch(r"[=\-~^\"'*#]+", lines[-1].strip() or "x"):
                continue
            para = " ".join(_MARKUP.sub(_role_text, _LINK.sub("`", line)).strip() for line in lines)
            if min_chars <= len(para) <= max_chars and para[-1] in ".:)?!":
                out.append(para)
    return out


def common_words(index: Path, vocab: set[str], min_len: int = 4) -> list[str]:
    """Headwords of a dictd index that are one token of `vocab` (a leading-space token: a frequent word)."""
    words = set()
    for line in index.read_text(encoding="utf-8", errors="replace").splitlines():
        w = line.split("\t", 1)[0].strip().lower()
        if len(w) >= min_len and w.isalpha() and w.isascii() and ("\u0120" + w) in vocab:
            words.add(w)
    return sorted(words)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--docs", type=Path, required=True, help="the documentation's _sources directory")
    p.add_argument("--dictionary", type=Path, required=True, help="a dictd .index file (gcide.index)")
    p.add_argument("--num-docs", type=int, default=6000)
    p.add_argument("--num-words", type=int, default=6000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    from blockspec.loading.bundled import bundled_default_path
    from blockspec.loading.gguf_io import load_gguf_tokenizer

    vocab = set(load_gguf_tokenizer(bundled_default_path()).get_vocab())
    rng = random.Random(a.seed)
    paras, words = doc_paragraphs(a.docs), common_words(a.dictionary, vocab)
    rng.shuffle(paras)
    rng.shuffle(words)
    prompts = [rng.choice(DOC_REQUESTS).format(t) for t in paras[: a.num_docs]]
    prompts += [rng.choice(WORD_REQUESTS).format(w) for w in words[: a.num_words]]
    rng.shuffle(prompts)
    kept = write_training_prompts(a.out, prompts)
    print(f"{len(kept.prompts)} prompts ({min(len(paras), a.num_docs)} of {len(paras)} documentation paragraphs, "
          f"{min(len(words), a.num_words)} of {len(words)} common words; {kept.dropped()}) -> {a.out}")


if __name__ == "__main__":
    main()
