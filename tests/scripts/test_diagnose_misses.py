"""``diagnose_misses.py``: the trigram yardstick counts the training answers and scores every answer position; the
extra prompt sets (``--sets``) sample the rows asked for, from chat records or prompt files alike."""

from __future__ import annotations

import json

import pytest
import torch
from test_wrappers import load_script


class WordTokenizer:
    """One id per whitespace-separated word (ids assigned on first sight)."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [self.ids.setdefault(w, len(self.ids)) for w in text.split()]}


def test_trigram_yardstick_names_what_the_answers_repeat(tmp_path):
    script = load_script("diagnose_misses")
    tok = WordTokenizer()
    answer = "the cat sat on the mat"
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": "q"},
                                            {"role": "assistant", "content": answer}]} for i in range(2)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ids = tok(answer)["input_ids"]
    # a prompt token, then the answer; the trigram (seen twice) predicts every answer token after the second
    sample = {"input_ids": torch.tensor([99] + ids), "loss_mask": torch.tensor([0] + [1] * len(ids))}
    result = script.trigram_yardstick(tok, [str(tmp_path / "train.jsonl")], [sample], {"chat": [0]})
    # positions p with answer tokens at p and p + 1 (p ≥ 1): 5; the first (p = 1) backs off to the bigram "the"
    # -> "cat" (also right): all five are named
    assert result == {"chat": {"positions": 5, "accepted": 5}}


class DecodingWordTokenizer(WordTokenizer):
    def decode(self, ids: list[int]) -> str:
        words = {i: w for w, i in self.ids.items()}
        return " ".join(words[i] for i in ids)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_sets_sample_rows_of_one_category_and_cut_answers(tmp_path):
    sampled_set = load_script("diagnose_misses").sampled_set
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"id": f"r{i}", "category": "code-tests" if i % 2 else "gsm8k",
         "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i}"},
                      {"role": "assistant", "content": " ".join(f"w{i}-{k}" for k in range(10))}]}
        for i in range(20)])
    spec = f"unseen={path}:4:14@code"
    name, conversations, prompts = sampled_set(spec, DecodingWordTokenizer(), per_set=3, answer_tokens=4)
    assert name == "unseen" and len(conversations) == 3 and prompts == []
    rows = [int(r["id"].rsplit("/", 1)[1]) for r in conversations]
    assert rows == sorted(rows) and all(4 <= i < 14 and i % 2 for i in rows)
    for r, i in zip(conversations, rows):
        assert r["id"].startswith("unseen/")
        assert r["messages"] == [{"role": "user", "content": f"q{i}"},
                                 {"role": "assistant", "content": " ".join(f"w{i}-{k}" for k in range(4))}]
    # the sample is fixed by the spec (a rerun resumes the same cache); another spec names its rows apart
    assert sampled_set(spec, DecodingWordTokenizer(), 3, 4)[1] == conversations
    other = sampled_set(f"unseen={path}:4:14@gsm8k", DecodingWordTokenizer(), 3, 4)[1]
    assert other[0]["id"].rsplit("/", 1)[0] != conversations[0]["id"].rsplit("/", 1)[0]
    assert len(sampled_set(spec, DecodingWordTokenizer(), 50, 4)[1]) == 5  # more than there are: all of them
    # --greedy-answers: the same rows, as prompts for the target to answer, named apart from the answers as written
    _, none, asked = sampled_set(spec, DecodingWordTokenizer(), 3, 4, greedy_answers=True)
    assert none == [] and [p["turns"] for p in asked] == [[f"q{i}"] for i in rows]
    assert asked[0]["id"].rsplit("/", 1)[0] != conversations[0]["id"].rsplit("/", 1)[0]


def test_sets_from_prompt_files_come_back_as_prompts_to_answer(tmp_path):
    sampled_set = load_script("diagnose_misses").sampled_set
    turns = [f"Explain idea number {i} in two sentences." for i in range(10)]
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"turns": [t, "and a follow-up"], "category": "magpie"}
                                                    for t in turns])
    name, conversations, prompts = sampled_set(f"new={path}", DecodingWordTokenizer(), per_set=4, answer_tokens=8)
    assert name == "new" and conversations == [] and len(prompts) == 4
    assert all(p["turns"] == [turns[int(p["id"].rsplit("/", 1)[1])]] for p in prompts)  # the first turn only
    # chat records without an answer are prompts too
    unanswered = write_jsonl(tmp_path / "asked.jsonl", [{"messages": [{"role": "user", "content": t}]} for t in turns])
    assert len(sampled_set(f"asked={unanswered}", DecodingWordTokenizer(), 4, 8)[2]) == 4


def test_sets_refuse_a_malformed_spec():
    with pytest.raises(SystemExit, match="NAME=FILE"):
        load_script("diagnose_misses").sampled_set("no-equals-sign", DecodingWordTokenizer(), 3, 4)
