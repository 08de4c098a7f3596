"""``diagnose_misses.py``: the trigram yardstick counts the training answers and scores every answer position."""

from __future__ import annotations

import json

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
