"""training.chat_requests: well-formed chat requests from frames × slot lists, deterministic for a seed, distinct,
spread over every kind and refused when they overlap the evaluation sets."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from hf_dspark.training import chat_requests
from hf_dspark.training.chat_requests import KINDS, chat_request_prompts
from hf_dspark.training.prompts import EvalOverlapGuard, _normalise, read_prompts

_A_BEFORE_VOWEL = re.compile(r"\b[Aa] (?!one|use|uni|Euro)[aeiouAEIOU]")
_AN_BEFORE_CONSONANT = re.compile(r"\b[Aa]n (?!hour|honest|X-)[b-df-hj-np-tv-zB-DF-HJ-NP-TV-Z]")


def texts(prompts):
    return [p.first_turn for p in prompts]


def test_same_seed_same_requests_other_seed_other_requests():
    assert texts(chat_request_prompts(200, seed=0)) == texts(chat_request_prompts(200, seed=0))
    assert set(texts(chat_request_prompts(200, seed=1))) != set(texts(chat_request_prompts(200, seed=0)))


def test_num_distinct_requests():
    prompts = chat_request_prompts(1000, seed=3)
    assert len(prompts) == 1000
    assert len({_normalise(t) for t in texts(prompts)}) == 1000


def test_every_kind_takes_its_turn():
    categories = [p.category for p in chat_request_prompts(300, seed=0)]
    assert set(categories) == {f"request-{kind}" for kind in KINDS}
    assert max(categories.count(c) for c in set(categories)) - min(categories.count(c) for c in set(categories)) <= 1


def test_requests_are_well_formed():
    for text in texts(chat_request_prompts(3000, seed=0)):
        assert "{" not in text and "}" not in text, text
        assert "  " not in text and text == text.strip(), text
        assert text[0].isupper() or text[0] == '"', text
        assert text[-1] in '.?!"', text
        assert not _A_BEFORE_VOWEL.search(text) and not _AN_BEFORE_CONSONANT.search(text), text


def test_requests_overlapping_the_evaluation_sets_are_refused():
    banned = chat_request_prompts(50, seed=0)[7].first_turn
    guarded = texts(chat_request_prompts(50, seed=0, guard=EvalOverlapGuard([banned])))
    assert banned not in guarded and len(guarded) == 50


def test_a_used_up_kind_gives_its_turns_away(monkeypatch, caplog):
    tiny = chat_requests._Kind("tiny", (chat_requests._group(["Say {word}."], word=["yes", "no"]),))
    monkeypatch.setattr(chat_requests, "_KINDS", (tiny,))
    with caplog.at_level(logging.WARNING, logger=chat_requests.__name__):
        prompts = chat_request_prompts(5)
    assert sorted(texts(prompts)) == ["Say no.", "Say yes."]
    assert "only 2 distinct chat requests" in caplog.text


# The subjects of data/heldout/chat.jsonl, the drafter's held-out chat prompts. Composed requests on those subjects
# would be near-copies of the test (the first tables had eight: a neighbour's loud music, a stripped screw, ...).
_HELDOUT_SUBJECTS = ("upstairs neighbour", "loud music", "stale", "cucumber", "afraid of", "guitar", "piano",
                     "stripped", "tulip", "escalate", "noise-cancelling", "lisbon", "landlord", "shelves", "sourdough",
                     "student loan", "weather and climate", "lighthouse", "stretches", "lower back", "whom", "feta",
                     "spinach", "romeo", "theseus", "laptop gets", "fan is loud", "tour guide", "castle", "hiking",
                     "forgot my birthday", "migrate")


def test_requests_stay_off_the_heldout_prompts():
    root = Path(__file__).resolve().parents[2]
    heldout = [t for name in ("chat", "code") for p in read_prompts(root / "data" / "heldout" / f"{name}.jsonl")
               for t in p.turns]
    assert len(heldout) == 48

    def runs_of_six(text: str) -> set[tuple[str, ...]]:
        words = re.findall(r"[a-z0-9]+", text.lower())
        return {tuple(words[i:i + 6]) for i in range(len(words) - 5)}

    heldout_runs = set().union(*(runs_of_six(t) for t in heldout))
    for text in texts(chat_request_prompts(20000, seed=0)):
        assert not runs_of_six(text) & heldout_runs, text
        assert not any(subject in text.lower() for subject in _HELDOUT_SUBJECTS), text
