"""Prompt files (training/prompts.py read_prompts): one that cannot be read names the file, the line and the problem
(a damaged line raised a bare JSONDecodeError, a line that is not a record an AttributeError)."""

from __future__ import annotations

import json

import pytest

from hf_dspark.training.prompts import Prompt, PromptFileError, read_prompts

BAD_PROMPT_FILES = {  # name -> (file name, contents, message after the path)
    "damaged line": ("p.jsonl", '{"turns": ["Hi"]}\n{"turns": ["Hi\n', ":2: not valid JSON (Unterminated string"),
    "not a record": ("p.jsonl", '{"turns": ["Hi"]}\n["Hi"]\n', ":2: a JSON list, not a record"),
    "unknown format": ("p.jsonl", '{"text": "Hi"}\n', ":1: Unrecognised prompt record (keys ['text'])"),
    "malformed messages": ("p.jsonl", '{"messages": "Hi"}\n', ":1: a malformed record ("),
    "json that is no list": ("p.json", '{"turns": ["Hi"]}', ": a .json prompt file holds a list of records, not a dict"),
    "damaged json": ("p.json", '[{"turns": ["Hi"]}', ": not valid JSON ("),
}


@pytest.mark.parametrize("case", list(BAD_PROMPT_FILES))
def test_a_prompt_file_that_cannot_be_read_names_the_file_and_line(case, tmp_path):
    name, contents, message = BAD_PROMPT_FILES[case]
    path = tmp_path / name
    path.write_text(contents)
    with pytest.raises(PromptFileError) as err:
        read_prompts(path)
    assert str(err.value).startswith(f"{path}{message}"), str(err.value)


def test_every_supported_prompt_format_reads(tmp_path):
    records = [{"turns": ["a", "b"]}, {"messages": [{"role": "user", "content": "c"}]},
               {"conversations": [{"from": "human", "value": "d"}]}, {"prompt": "e", "category": "x"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    assert read_prompts(tmp_path / "p.jsonl") == [Prompt(("a", "b")), Prompt(("c",)), Prompt(("d",)),
                                                  Prompt(("e",), "x")]
