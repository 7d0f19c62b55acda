"""Regenerate ``sft.jsonl``, the prompt/response pairs the Hugging Face example fine-tunes on.

Each line is ``{"prompt": ..., "response": ...}``: the first sentence of a paragraph of the shipped
corpus (``synthetic_stories.txt``) and the sentence that follows it, for the first
:data:`PAIRS` paragraphs that have two sentences short enough for the tiny model's context. It is
a pure function of the corpus, so it carries the corpus's licence (the project's own work,
Apache-2.0) and is reproducible byte for byte. Run it from the repository root:

    python -m airflow_provider_spotsched.data.text.generate_sft
"""

from __future__ import annotations

import json
import re
from pathlib import Path

CORPUS = Path(__file__).with_name("synthetic_stories.txt")
OUTPUT = Path(__file__).with_name("sft.jsonl")
PAIRS = 300
MAX_CHARS = 120  # per side: prompt + response stay well inside a 64-token sample of the tiny model
SENTENCE_END = re.compile(r'(?<=[.!?])"?\s+')


def sentences(paragraph: str) -> list[str]:
    """The paragraph's sentences, a closing quote kept with the sentence it ends."""
    parts, start = [], 0
    for match in SENTENCE_END.finditer(paragraph):
        parts.append(paragraph[start:match.end()].strip())
        start = match.end()
    parts.append(paragraph[start:].strip())
    return [part for part in parts if part]


def generate(corpus: str, pairs: int = PAIRS) -> str:
    """The JSONL text: one prompt/response pair per qualifying paragraph, in corpus order."""
    lines = []
    for paragraph in corpus.split("\n\n"):
        parts = sentences(paragraph.strip())
        if len(parts) >= 2 and all(len(part) <= MAX_CHARS for part in parts[:2]):
            lines.append(json.dumps({"prompt": parts[0], "response": parts[1]}, ensure_ascii=False))
            if len(lines) == pairs:
                break
    if len(lines) < pairs:
        raise ValueError(f"the corpus yields only {len(lines)} prompt/response pairs, {pairs} wanted")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(generate(CORPUS.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote {OUTPUT} ({OUTPUT.stat().st_size} bytes)")
