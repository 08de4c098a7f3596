"""Documentation as chat records: RST sections with roles reduced and literal blocks fenced, HTML manuals split at
their headings, FAQ questions answered by their text; held-out modules never read, evaluation overlaps dropped."""

from __future__ import annotations

import gzip
import json

from hf_dspark.training import document_text
from hf_dspark.training.document_text import (faq_text_records, html_manual_records, sphinx_source_records,
                                              write_records)
from hf_dspark.training.prompts import EvalOverlapGuard

WORDS = " ".join(f"word{i}" for i in range(50))

RST = f"""\
.. _tut-x:

*************
Control Flow
*************

The :keyword:`while` statement repeats; see :func:`range <builtins.range>` and ``len``.
It is wrapped
over lines. {WORDS}

.. index::
   single: for; statement

For example::

   >>> for i in range(3):
   ...     print(i)

- one item
- another item

How to loop
===========

Use a ``for`` loop. {WORDS}
"""


def test_rst_sections_become_records(tmp_path, monkeypatch):
    (tmp_path / "tutorial").mkdir()
    (tmp_path / "tutorial" / "controlflow.rst.txt").write_text(RST)
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "statistics.rst.txt").write_text(RST)  # a held-out module: never read
    records = sphinx_source_records(tmp_path)
    assert len(records) == 2
    first, second = (r["messages"] for r in records)
    assert "Control Flow" in first[0]["content"] and second[0]["content"] == "How to loop?"
    answer = first[1]["content"]
    assert "The while statement repeats; see range and `len`. It is wrapped over lines." in answer
    assert "```\n>>> for i in range(3):\n...     print(i)\n```" in answer and "For example:" in answer
    assert "single: for" not in answer and "- one item\n- another item" in answer and ":keyword:" not in answer


def test_html_manual_and_faq(tmp_path):
    (tmp_path / "ch01.en.html").write_text(
        f"<html><body><nav>menu</nav><h2>3.1. Package management</h2><p>Use <b>apt</b> to install. {WORDS}</p>"
        "<pre>apt install foo\n</pre><h2>Empty</h2></body></html>")
    (record,) = html_manual_records(tmp_path)
    question, answer = (m["content"] for m in record["messages"])
    assert "Package management (Debian)" in question and "3.1" not in question and "menu" not in answer
    assert answer.startswith("Use apt to install.") and "```\napt install foo\n```" in answer
    faq = tmp_path / "faq.txt"
    faq.write_text(f"1.1. What is Debian?\n\nDebian is a free operating system. {WORDS}\n\n1.2. Not a question\n")
    (record,) = faq_text_records(faq)
    assert record["messages"][0]["content"] == "What is Debian?"


def test_records_overlapping_evaluation_prompts_are_dropped(tmp_path):
    evaluation = "please write a function that returns the sum of the squares of the first n odd natural numbers"
    records = [document_text._record("x", "Explain sums.", f"Here: {evaluation}. {WORDS}"),
               document_text._record("x", "Explain loops.", WORDS)]
    assert write_records(records, tmp_path / "out.jsonl.gz", "doc", EvalOverlapGuard([evaluation])) == 1
    (line,) = gzip.open(tmp_path / "out.jsonl.gz", "rt").read().splitlines()
    assert json.loads(line)["id"] == "doc-00000"
