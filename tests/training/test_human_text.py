"""Human-written records for off-policy distillation: shapes, sources kept apart, overlap guard applied."""

from __future__ import annotations

from hf_dspark.training.human_text import (_readme_sections, _strip_docstring, code_source_records,
                                           pydoc_topic_records, stdlib_test_records)
from hf_dspark.training.prompts import EvalOverlapGuard


def _is_chat_record(r: dict) -> bool:
    roles = [m["role"] for m in r["messages"]]
    return roles == ["user", "assistant"] and all(m["content"].strip() for m in r["messages"])


def test_code_source_records_answer_with_the_real_source():
    records = code_source_records(["textwrap"], seed=0)
    assert records and all(_is_chat_record(r) for r in records)
    implement = [r for r in records if r["category"] == "human-code-implement"]
    assert implement and all(r["messages"][1]["content"].startswith("```python\n") for r in implement)
    assert any("def dedent" in r["messages"][1]["content"] or "def indent" in r["messages"][1]["content"]
               or "class TextWrapper" in r["messages"][1]["content"] for r in records)


def test_only_the_given_modules_are_read():
    records = code_source_records(["textwrap"]) + stdlib_test_records(["textwrap"])
    assert not any("heapq" in m["content"] for r in records for m in r["messages"])


def test_guard_drops_overlapping_records():
    records = pydoc_topic_records()
    assert records and all(_is_chat_record(r) for r in records)
    answer = records[0]["messages"][1]["content"]
    guard = EvalOverlapGuard([answer[:400]])
    assert len(pydoc_topic_records(guard=guard)) == len(records) - 1


def test_strip_docstring_keeps_the_body():
    assert _strip_docstring('def f():\n    r"""Doc\n    more."""\n    return 1\n') == "def f():\n    return 1\n"


def test_readme_sections_markdown_and_rst():
    text = "# Title\nintro\n## Install\npip it\nUsage\n-----\ncall it\n"
    assert _readme_sections(text) == [("Title", "intro"), ("Install", "pip it"), ("Usage", "call it")]
