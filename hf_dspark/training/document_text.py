"""Documentation on this machine as chat records: explanatory prose and examples for off-policy distillation.

The drafter is weakest on chat-like prose the context does not repeat, and the human-written text the project had
(standard-library source, tests, README sections) is mostly code. Installed documentation is the largest body of
explanatory English a machine without a hub has; each section becomes a request ("Explain ...", "How do I ...")
answered by the section itself:

* :func:`sphinx_source_records` — reStructuredText sources of Sphinx documentation (the Python documentation of
  Debian's ``python3.11-doc``: tutorial, HOWTOs, FAQ, library and language reference), roles and directives
  reduced to their text, ``::`` literal blocks fenced as code;
* :func:`html_manual_records` — HTML manuals split at their headings (``debian-reference-en``);
* :func:`faq_text_records` — plain-text FAQs whose numbered headings are questions (``debian-faq``).

Sections about the held-out modules (``prompt_sources.HELD_OUT_CODE_MODULES``) are never read, and every record
overlapping an evaluation prompt is dropped (``EvalOverlapGuard``). Run as a module to write the files the
continuous training reads::

    apt-get install python3.11-doc debian-reference-en debian-faq
    python -m hf_dspark.training.document_text --out data/human --local-out runs/human

Licences decide where a file goes: the Python documentation (PSF licence) is written to ``--out`` (committed,
``data/human``); the Debian reference (GPL-2+) and FAQ (verbatim-copy licence) to ``--local-out`` (``runs/``, never
committed), regenerated on each machine by the same command.
"""

from __future__ import annotations

import argparse
import gzip
import html.parser
import json
import logging
import random
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from .prompt_sources import HELD_OUT_CODE_MODULES
from .prompts import EvalOverlapGuard

logger = logging.getLogger(__name__)

PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
DEBIAN_REFERENCE = Path("/usr/share/doc/debian-reference-en/docs")
DEBIAN_FAQ = Path("/usr/share/doc/debian/FAQ/debian-faq.en.txt.gz")
MIN_WORDS, MAX_WORDS = 40, 400  # shorter sections teach too few blocks; longer ones are cut at a paragraph
_EXPLAIN = ("Explain {title}.", "Can you explain {title} to me?", "What should I know about {title}?",
            "Tell me about {title}.", "I'm reading about {title}. What does it mean?",
            "Give me an overview of {title}.")
_IN_CONTEXT = " ({context})"


def _record(category: str, request: str, answer: str) -> dict:
    return {"category": category, "finish_reason": "stop",
            "messages": [{"role": "user", "content": request}, {"role": "assistant", "content": answer.strip()}]}


def _chunks(paragraphs: list[str]) -> Iterator[str]:
    """Paragraphs joined into answers of MIN_WORDS..MAX_WORDS words, cut only between paragraphs."""
    current, words = [], 0
    for paragraph in paragraphs:
        n = len(paragraph.split())
        if current and words + n > MAX_WORDS:
            if words >= MIN_WORDS:
                yield "\n\n".join(current)
            current, words = [], 0
        current.append(paragraph)
        words += n
    if words >= MIN_WORDS:
        yield "\n\n".join(current)


def _request(rng: random.Random, title: str, context: str | None) -> str:
    title = title.strip().rstrip(".:")
    if title.endswith("?"):
        return title
    if re.match(r"(?i)^how (to|do|can)\b", title):
        return title[0].upper() + title[1:] + "?"
    suffix = _IN_CONTEXT.format(context=context) if context else ""
    return rng.choice(_EXPLAIN).format(title=title + suffix)


# ---------------------------------------------------------------------------------------------------------
# Sphinx reStructuredText
# ---------------------------------------------------------------------------------------------------------
_HEADING_CHARS = "=-~*^\"'+#"
_DROPPED_DIRECTIVES = {"index", "toctree", "highlight", "module", "currentmodule", "sectionauthor", "moduleauthor",
                       "productionlist", "testsetup", "testcleanup", "only", "raw", "include", "literalinclude",
                       "audit-event", "impl-detail", "availability", "tabularcolumns", "csv-table", "image", "figure"}
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`!?~?([^`<]*?)(?:\s*<[^>]*>)?`")


def _rst_inline(text: str) -> str:
    text = _ROLE.sub(lambda m: m.group(1), text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return re.sub(r"`([^`<]+?) <[^>]+>`_+", r"\1", text)


_LIST_ITEM = re.compile(r"^([-*+]|#\.|\d+\.)\s")


def _unwrap(lines: list[str]) -> str:
    """Hard-wrapped source lines as the prose a model writes: one line per paragraph or list item."""
    out: list[str] = []
    for line in lines:
        if out and not _LIST_ITEM.match(line):
            out[-1] += " " + line
        else:
            out.append(line)
    return "\n".join(out)


def _rst_sections(source: str) -> Iterator[tuple[str, list[str]]]:
    """(heading, paragraphs) of an RST document; directives dropped (their content kept), literal blocks fenced."""
    lines = source.splitlines()
    title, paragraphs, block, literal = None, [], [], None

    def flush_block():
        nonlocal block
        if block:
            text = "\n".join(block).strip("\n") if block[0] == "```" else _unwrap(block)
            if text.strip():
                paragraphs.append(text)
        block = []

    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if literal is not None:  # inside a literal block: indented lines (or blanks) belong to it
            if line.strip() == "" or line.startswith(" " * literal):
                if line.strip() or len(block) > 1:  # no blank line right after the opening fence
                    block.append(line[literal:] if line.strip() else "")
                i += 1
                continue
            while block and not block[-1].strip():
                block.pop()
            block.append("```")
            flush_block()
            literal = None
        if nxt and len(set(nxt.strip())) == 1 and nxt.strip()[0] in _HEADING_CHARS and len(nxt.strip()) >= 3 \
                and line.strip() and len(nxt.strip()) >= len(line.strip()) - 1 and not line.startswith(" "):
            flush_block()
            if title is not None and paragraphs:
                yield title, paragraphs
            title, paragraphs = _rst_inline(line.strip()), []
            i += 2
            continue
        if set(line.strip()) <= set(_HEADING_CHARS) and len(line.strip()) >= 3:  # overline of a title
            i += 1
            continue
        stripped = line.strip()
        if stripped.startswith(".. "):  # a directive, target or comment: its options are dropped
            flush_block()
            name = stripped[3:].split("::")[0].strip()
            indent = len(line) - len(line.lstrip())
            i += 1
            while i < len(lines) and lines[i].strip().startswith(":"):
                i += 1
            if "::" not in stripped or name in _DROPPED_DIRECTIVES:  # a comment or index: its block goes too
                while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                    i += 1
            continue
        if stripped == "":
            flush_block()
            i += 1
            continue
        text = _rst_inline(line)
        if stripped.endswith("::"):
            block.append(text.rstrip(":").rstrip() + (":" if stripped != "::" else ""))
            flush_block()
            indent = next((len(s) - len(s.lstrip()) for s in lines[i + 1:] if s.strip()), 3)
            literal, block = max(indent, 1), ["```"]
            i += 1
            continue
        block.append(text.strip())
        i += 1
    flush_block()
    if title is not None and paragraphs:
        yield title, paragraphs


def sphinx_source_records(root: Path = PYTHON_DOCS, seed: int = 0, context: str = "Python",
                          exclude: Iterable[str] = HELD_OUT_CODE_MODULES) -> list[dict]:
    """One record per section chunk of every ``*.rst.txt`` / ``*.rst`` under ``root`` (held-out modules skipped)."""
    rng = random.Random(seed)
    skipped = {name.split(".")[0] for name in exclude}
    records = []
    for path in sorted(root.rglob("*.rst*")):
        if path.name.split(".")[0] in skipped or "whatsnew" in path.parts or "c-api" in path.parts:
            continue
        for title, paragraphs in _rst_sections(path.read_text(encoding="utf-8", errors="replace")):
            for answer in _chunks(paragraphs):
                records.append(_record("human-docs-python", _request(rng, title, context), answer))
    return records


# ---------------------------------------------------------------------------------------------------------
# HTML manuals
# ---------------------------------------------------------------------------------------------------------
class _HtmlSections(html.parser.HTMLParser):
    """Text of an HTML page split at h1-h3 headings; ``pre`` kept as fenced code."""

    def __init__(self):
        super().__init__()
        self.sections: list[tuple[str, list[str]]] = []
        self._title, self._paragraphs, self._text, self._in = None, [], [], None
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "nav"):
            self._skip += 1
        elif tag in ("h1", "h2", "h3"):
            self._end_paragraph()
            self._end_section()
            self._in = "heading"
        elif tag in ("p", "li", "pre", "dd", "dt", "tr"):
            self._end_paragraph()
            self._in = tag

    def handle_endtag(self, tag):
        if tag in ("script", "style", "nav"):
            self._skip = max(0, self._skip - 1)
        elif tag in ("h1", "h2", "h3") and self._in == "heading":
            self._title = " ".join("".join(self._text).split())
            self._text, self._in = [], None
        elif tag in ("p", "li", "pre", "dd", "dt", "tr"):
            self._end_paragraph()

    def handle_data(self, data):
        if not self._skip:
            self._text.append(data)

    def _end_paragraph(self):
        text = "".join(self._text)
        self._text = []
        if self._in == "heading":
            return
        if self._in == "pre":
            text = "```\n" + text.strip("\n") + "\n```" if text.strip() else ""
        else:
            text = " ".join(text.split())
            if self._in == "li" and text:
                text = "- " + text
        if text:
            self._paragraphs.append(text)
        self._in = None

    def _end_section(self):
        if self._title and self._paragraphs:
            self.sections.append((self._title, self._paragraphs))
        self._title, self._paragraphs = None, []

    def close(self):
        super().close()
        self._end_paragraph()
        self._end_section()


def html_manual_records(root: Path = DEBIAN_REFERENCE, seed: int = 0, context: str = "Debian") -> list[dict]:
    rng = random.Random(seed)
    records = []
    for path in sorted(root.glob("*.html")):
        parser = _HtmlSections()
        parser.feed(path.read_text(encoding="utf-8", errors="replace"))
        parser.close()
        for title, paragraphs in parser.sections:
            title = re.sub(r"^[\d.]+\s*", "", title)  # "3.2.1. Title" -> "Title"
            for answer in _chunks(paragraphs):
                records.append(_record("human-docs-manual", _request(rng, title, context), answer))
    return records


# ---------------------------------------------------------------------------------------------------------
# Plain-text FAQs
# ---------------------------------------------------------------------------------------------------------
def faq_text_records(path: Path = DEBIAN_FAQ) -> list[dict]:
    """Questions (numbered headings ending in '?') answered by the text under them."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    records, question, paragraphs, block = [], None, [], []
    heading = re.compile(r"^\s*\d+(\.\d+)+\.?\s+(.+\?)\s*$")

    def close():
        if question and paragraphs:
            for answer in _chunks(paragraphs):
                records.append(_record("human-docs-faq", question, answer))

    for line in lines + [""]:
        match = heading.match(line)
        if match:
            if block:
                paragraphs.append(" ".join(block))
            close()
            question, paragraphs, block = match.group(2).strip(), [], []
        elif not line.strip() or set(line.strip()) <= set("-=*"):
            if block:
                paragraphs.append(" ".join(block))
            block = []
        else:
            block.append(line.strip())
    close()
    return records


# ---------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------
def write_records(records: list[dict], out: Path, prefix: str, guard: EvalOverlapGuard | None, seed: int = 0) -> int:
    """Drop records overlapping the evaluation prompts, shuffle, number and write them as jsonl.gz."""
    kept = [r for r in records
            if guard is None or not any(guard.overlaps(m["content"]) for m in r["messages"])]
    random.Random(seed).shuffle(kept)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt", encoding="utf-8") as f:
        for i, record in enumerate(kept):
            f.write(json.dumps({"id": f"{prefix}-{i:05d}", **record}, ensure_ascii=False) + "\n")
    logger.info("%s: %d records (%d dropped as overlapping evaluation prompts)", out, len(kept),
                len(records) - len(kept))
    return len(kept)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/human", help="sources whose licence allows committing them")
    p.add_argument("--local-out", default="runs/human", help="sources kept out of the repository")
    p.add_argument("--eval-dir", default="../shared/eval_datasets")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    guard = EvalOverlapGuard.from_dir(args.eval_dir)
    sources = [("python-docs", PYTHON_DOCS, sphinx_source_records, args.out),
               ("debian-reference", DEBIAN_REFERENCE, html_manual_records, args.local_out),
               ("debian-faq", DEBIAN_FAQ, faq_text_records, args.local_out)]
    for name, path, read, out in sources:
        if not path.exists():
            logger.warning("%s not found: install its Debian package (see the module docstring)", path)
            continue
        write_records(read(path), Path(out) / f"{name}.jsonl.gz", name, guard)


if __name__ == "__main__":
    main()
