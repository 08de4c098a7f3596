"""Human-written text as chat records, for off-policy distillation (a prefill-only target pass, no regeneration).

A target forward over given text yields the target's features and its next-token distribution at every position
— everything the drafter's loss needs — for about a third of the cost of generating that text, and the text can
be as diverse as what lies on the machine. Each source pairs a request with human text that answers it:

* :func:`code_source_records` — standard-library functions and classes: "implement this docstring" answered by
  the real source, "write a docstring" answered by the documented source, "explain" answered by the docstring;
* :func:`stdlib_test_records` — ``unittest`` test classes of the standard library's own test suite, answering
  "write unit tests for ...";
* :func:`pydoc_topic_records` — the Python language reference topics that ``help()`` shows (prose and examples);
* :func:`package_readme_records` — the README sections in installed packages' metadata (markdown / rst);
* GSM8K human solutions: :func:`~hf_dspark.training.prompt_sources.gsm8k_solution_records`.

Only modules the caller passes are read (the recipe passes ``TRAIN_CODE_MODULES``, never the held-out ones), and
every record whose request or answer overlaps an evaluation prompt is dropped when a guard is given.
"""

from __future__ import annotations

import ast
import email
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path

from .prompt_sources import _code_prompt, iter_code_objects
from .prompts import EvalOverlapGuard

_MAX_ANSWER_CHARS = 4000  # ~1,000 tokens: the cache's default max length


def _record(category: str, request: str, answer: str) -> dict:
    return {"category": category, "finish_reason": "stop",
            "messages": [{"role": "user", "content": request}, {"role": "assistant", "content": answer.strip()}]}


def _keep(records: Iterable[dict], guard: EvalOverlapGuard | None) -> list[dict]:
    kept = []
    for r in records:
        texts = [m["content"] for m in r["messages"]]
        if guard is None or not any(guard.overlaps(t) for t in texts):
            kept.append(r)
    return kept


def _strip_docstring(source: str) -> str:
    """The source without its first docstring line(s), prefixes (r, b, u) and indentation included."""
    return re.sub(r'^[ \t]*[rRbBuU]?(""".*?"""|\'\'\'.*?\'\'\')[ \t]*\n', "", source, count=1, flags=re.S | re.M)


def code_source_records(module_names: Sequence[str], seed: int = 0, max_source_lines: int = 80,
                        guard: EvalOverlapGuard | None = None) -> list[dict]:
    """One record per public function / class with readable source: implement, docstring or explain."""
    rng = random.Random(seed)
    records = []
    for obj in iter_code_objects(module_names, max_source_lines=max_source_lines):
        if not obj.source:
            continue
        style = rng.choice(("implement", "implement", "docstring", "explain"))
        code = f"```python\n{obj.source.rstrip()}\n```"
        if style == "implement":
            request = _code_prompt(obj, "implement", rng)
            records.append(_record("human-code-implement", request, code))
        elif style == "docstring":
            stripped = _strip_docstring(obj.source).rstrip()
            request = f"Write a clear docstring for this Python code:\n```python\n{stripped}\n```"
            records.append(_record("human-code-docstring", request, code))
        else:
            request = f"Explain what this Python code does:\n```python\n{_strip_docstring(obj.source).rstrip()}\n```"
            records.append(_record("human-code-explain", request, obj.doc))
    rng.shuffle(records)
    return _keep(records, guard)


def _stdlib_test_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "test"


def stdlib_test_records(module_names: Sequence[str], max_lines: int = 90,
                        guard: EvalOverlapGuard | None = None) -> list[dict]:
    """``unittest.TestCase`` classes of ``test_<module>.py`` (≤ max_lines) answering 'write tests for ...'."""
    records = []
    test_dir = _stdlib_test_dir()
    for module_name in module_names:
        short = module_name.split(".")[-1]
        for path in sorted({test_dir / f"test_{short}.py", test_dir / f"test_{module_name.replace('.', '_')}.py"}):
            if not path.is_file():
                continue
            source = path.read_text(encoding="utf-8", errors="replace")
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            lines = source.splitlines()
            for node in tree.body:
                if not isinstance(node, ast.ClassDef) or not node.name.startswith("Test") and \
                        not node.name.endswith("Test") and not node.name.endswith("Tests"):
                    continue
                body = "\n".join(lines[node.lineno - 1: node.end_lineno])
                if node.end_lineno - node.lineno + 1 > max_lines or "def test" not in body:
                    continue
                subject = re.sub(r"(^Test_?|_?Tests?$)", "", node.name) or short
                request = (f"Write unittest tests for the `{module_name}` module"
                           + (f", covering {subject}." if subject.lower() != short else "."))
                records.append(_record("human-code-tests", request, f"```python\n{body}\n```"))
    return _keep(records, guard)


def pydoc_topic_records(guard: EvalOverlapGuard | None = None) -> list[dict]:
    """The language-reference topics of ``help('topics')``, one record per topic (cut at ~1,000 tokens)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    records = []
    for key, text in sorted(topics.items()):
        title = key.replace("-", " ")
        text = textwrap.dedent(text).strip()
        if len(text.split()) < 40:
            continue
        records.append(_record("human-docs-python", f"Explain {title} in Python.", text[:_MAX_ANSWER_CHARS]))
    return _keep(records, guard)


def _readme_sections(description: str) -> list[tuple[str, str]]:
    """(heading, body) of markdown '#'/'##' sections or rst underlined headings."""
    heading = re.compile(r"^(#{1,3})\s+(.+)$|^(.+)\n([=\-~^]{3,})\s*$", re.M)
    marks = list(heading.finditer(description))
    sections = []
    for m, nxt in zip(marks, marks[1:] + [None]):
        title = (m.group(2) or m.group(3) or "").strip().strip("*`#")
        body = description[m.end(): nxt.start() if nxt else len(description)].strip()
        sections.append((title, body))
    return sections


def package_readme_records(site_packages: Sequence[str | Path] | None = None, min_words: int = 60,
                           guard: EvalOverlapGuard | None = None) -> list[dict]:
    """README sections from the long descriptions of installed distributions ('*.dist-info/METADATA')."""
    dirs = [Path(p) for p in (site_packages or [p for p in sys.path if p.endswith("site-packages")])]
    records, seen = [], set()
    for meta_path in sorted(m for d in dirs for m in d.glob("*.dist-info/METADATA")):
        message = email.message_from_string(meta_path.read_text(encoding="utf-8", errors="replace"))
        name, description = message.get("Name", meta_path.parent.name), message.get_payload()
        if not isinstance(description, str) or name.lower() in seen:
            continue
        seen.add(name.lower())
        for title, body in _readme_sections(description):
            if len(body.split()) < min_words or re.search(r"change ?log|release notes|history|license", title, re.I):
                continue
            request = f"Write the \"{title}\" section of the documentation for the Python package {name}."
            records.append(_record("human-docs-readme", request, body[:_MAX_ANSWER_CHARS]))
    return _keep(records, guard)


__all__ = ["code_source_records", "package_readme_records", "pydoc_topic_records", "stdlib_test_records"]
