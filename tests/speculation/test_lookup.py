"""Lookup proposer (speculation/lookup.py) and its survival estimates (speculation/lookup_calibration.py)."""

from __future__ import annotations

import gc
import random

import pytest

from hf_dspark.speculation.lookup import (NO_PROPOSAL, LookupHistory, LookupHistoryKey, LookupIndex, LookupProposal,
                                         LookupProposer)
from hf_dspark.speculation.lookup_calibration import (DEFAULT_PRIOR, DEFAULT_SUPPORT_FACTOR, LookupCalibrator,
                                                     match_bucket, support_bucket)

KEY_A = LookupHistoryKey("target-x", "tok-x", scope="user-a")
KEY_B = LookupHistoryKey("target-x", "tok-x", scope="user-b")


class WordVocab:
    """Whitespace 'tokenizer' for readable hand-made sequences."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.ids.setdefault(word, len(self.ids)) for word in text.split()]

    def decode(self, ids) -> str:
        words = {i: w for w, i in self.ids.items()}
        return " ".join(words[i] for i in ids)


def reference_proposal(seq: list[int], min_match: int, max_match: int, max_tokens: int) -> LookupProposal:
    """Brute force over the whole sequence: what the incremental index must return (module docstring)."""

    def continuations(window):
        n, found = len(window), {}
        for i in range(n, len(seq)):
            if seq[i - n:i] == window:
                count, _ = found.get(seq[i], (0, -1))
                found[seq[i]] = (count + 1, i)
        return found

    order = next((n for n in range(min(max_match, len(seq)), min_match - 1, -1)
                  if continuations(seq[len(seq) - n:])), 0)
    if order == 0 or max_tokens <= 0:
        return NO_PROPOSAL
    window, tokens, counts, totals = seq[len(seq) - order:], [], [], []
    while len(tokens) < max_tokens:
        found = continuations(window)
        if not found:
            break
        token = max(found, key=lambda t: found[t])  # (count, latest position): ties -> most recent
        tokens.append(token)
        counts.append(found[token][0])
        totals.append(sum(c for c, _ in found.values()))
        window = window[1:] + [token]
    return LookupProposal(tuple(tokens), order, tuple(counts), tuple(totals))


# ---------------------------------------------------------------------------------------------------------
# Hand-made sequences
# ---------------------------------------------------------------------------------------------------------
def test_repeated_json_keys_propose_the_earlier_object():
    vocab = WordVocab()
    first = '{ "tool" : "get_weather" , "arguments" : { "city" : "Paris" } }'
    second = '{ "tool" : "calculator" , "arguments" : { "expression" : "x" } }'
    seq = vocab.encode(f'{first} {second} {{ "tool" : "get_weather" , "arguments" :')
    proposal = LookupIndex(8, seq).propose(max_tokens=6)
    assert vocab.decode(proposal.tokens) == '{ "city" : "Paris" } }'
    assert proposal.match_length == 7  # '{ "tool" : "get_weather" , "arguments" :' (its '}' prefix is new)
    assert proposal.counts == (1,) * 6 and proposal.source == "row"


def test_copied_sentence_is_proposed_after_two_tokens():
    vocab = WordVocab()
    sentence = "hold the reset button for ten seconds then log in as admin"
    proposer = LookupProposer(max_tokens=16)
    proposer.start_row(0, vocab.encode(f"tool result : {sentence} . user : what do i do ?"))
    proposer.commit(0, vocab.encode("you should hold the"))
    (proposal,) = proposer.propose([0])
    assert proposal.match_length == 2  # 'hold the'; 'should hold the' was never seen
    assert vocab.decode(proposal.tokens) == "reset button for ten"  # capped at ceil(2.0 * 2) = 4 drafts
    proposer.commit(0, proposal.tokens)  # all accepted: the match is now 6 tokens long
    (proposal,) = proposer.propose([0])
    assert proposal.match_length == 6
    assert vocab.decode(proposal.tokens) == "seconds then log in as admin . user : what do i"  # 12 = 2.0 * 6


def test_longest_match_wins_over_a_more_frequent_short_match():
    vocab = WordVocab()
    seq = vocab.encode("a b X c b Y d b Y e b Y a b")
    proposal = LookupIndex(8, seq).propose(max_tokens=1)
    assert vocab.decode(proposal.tokens) == "X"  # 'a b' -> X beats 'b' -> Y (3 of 4)
    assert proposal.match_length == 2
    assert LookupIndex(8, seq[:-2] + vocab.encode("z b")).propose(1).tokens == tuple(vocab.encode("Y"))


def test_most_frequent_continuation_wins_and_ties_go_to_the_most_recent():
    vocab = WordVocab()
    seq = vocab.encode('a { "tool" : calc } b { "tool" : calc } c { "tool" : weather } d { "tool" :')
    proposal = LookupIndex(8, seq).propose(max_tokens=3)
    assert proposal.match_length == 3  # '{ "tool" :'; 'd {' is new
    assert vocab.decode(proposal.tokens) == "calc } c"  # calc 2 of 3; ': calc }' -> b or c: tie -> c (latest)
    assert proposal.counts == (2, 2, 1) and proposal.totals == (3, 2, 2)
    assert proposal.count == 2


def test_no_match_and_zero_cap_propose_nothing():
    assert LookupIndex(8, [1, 2, 3]).propose(8) is NO_PROPOSAL
    assert LookupIndex(8, []).propose(8) is NO_PROPOSAL
    assert LookupIndex(8, [1, 2, 1]).propose(0) is NO_PROPOSAL
    assert LookupIndex(8, [1, 2, 1, 2]).propose(8, min_match=3) is NO_PROPOSAL


# ---------------------------------------------------------------------------------------------------------
# Incremental == from scratch
# ---------------------------------------------------------------------------------------------------------
def _random_stream(rng: random.Random) -> list[int]:
    vocab = rng.randint(2, 6)
    seq: list[int] = []
    while len(seq) < rng.randint(0, 90):
        if seq and rng.random() < 0.3:  # copy an earlier span: long matches
            start = rng.randrange(len(seq))
            seq += seq[start:start + rng.randint(1, 12)]
        else:
            seq.append(rng.randrange(vocab))
    return seq


@pytest.mark.parametrize("max_match", [1, 3, 8])
def test_incremental_index_equals_brute_force_on_random_streams(max_match):
    rng = random.Random(max_match)
    for _ in range(40):
        seq = _random_stream(rng)
        min_match, max_tokens = rng.randint(1, max_match), rng.randint(0, 10)
        incremental, position = LookupIndex(max_match), 0
        while position < len(seq):
            step = rng.randint(1, 4)
            incremental.extend(seq[position:position + step])
            position = min(position + step, len(seq))
            expected = reference_proposal(seq[:position], min_match, max_match, max_tokens)
            assert incremental.propose(max_tokens, min_match) == expected, (seq[:position], min_match)
        assert LookupIndex(max_match, seq).propose(max_tokens, min_match) == incremental.propose(max_tokens, min_match)


def test_proposer_commits_match_a_fresh_index_of_the_same_tokens():
    rng = random.Random(7)
    proposer = LookupProposer(max_tokens=8, long_match_tokens=8, tokens_per_match=100.0)
    streams = {row: _random_stream(rng) + [0] for row in range(6)}
    for row, seq in streams.items():
        proposer.start_row(row, seq[:5])
    for position in range(5, max(map(len, streams.values()))):
        live = [row for row, seq in streams.items() if position < len(seq)]
        for row in live:
            proposer.commit(row, [streams[row][position]])
        for row, proposal in zip(live, proposer.propose(live)):
            assert proposal == LookupIndex(8, streams[row][:position + 1]).propose(8), row
            assert proposer.row_length(row) == position + 1


# ---------------------------------------------------------------------------------------------------------
# Proposer: caps, rows, errors
# ---------------------------------------------------------------------------------------------------------
def test_length_cap_grows_with_the_match():
    seq = list(range(20)) + list(range(20))  # copy in progress: every n up to 8 matches
    proposer = LookupProposer(max_tokens=4, long_match_tokens=10, tokens_per_match=2.0)
    proposer.start_row("copy", seq[:20] + seq[:3])
    assert proposer.propose(["copy"])[0].tokens == (3, 4, 5, 6)  # n = 3: min(4, 6)
    proposer.commit("copy", [3, 4, 5, 6, 7])
    assert proposer.propose(["copy"])[0].match_length == 8
    assert len(proposer.propose(["copy"])[0]) == 10  # a max_match match goes beyond the block: long_match_tokens
    assert len(proposer.propose(["copy"], max_tokens=12)[0]) == 12
    proposer.start_row("short", [5, 9, 5])
    assert proposer.propose(["short"], max_tokens=[8])[0].tokens == (9, 5)  # n = 1: ceil(2.0 * 1)
    assert proposer.propose(["short", "copy"], max_tokens=0) == [NO_PROPOSAL, NO_PROPOSAL]


def test_proposer_rows_are_independent_and_validated():
    proposer = LookupProposer()
    proposer.start_row("a", [1, 2, 3, 1, 2])
    proposer.start_row("b", [7, 8, 9])
    assert proposer.propose(["a", "b"]) == [LookupIndex(8, [1, 2, 3, 1, 2]).propose(4), NO_PROPOSAL]
    with pytest.raises(ValueError, match="already active"):
        proposer.start_row("a", [1])
    with pytest.raises(KeyError, match="call start_row first"):
        proposer.commit("zzz", [1])
    with pytest.raises(ValueError, match="2 max_tokens for 1 rows"):
        proposer.propose(["a"], max_tokens=[1, 2])
    proposer.end_row("a")
    with pytest.raises(KeyError, match="unknown row"):
        proposer.end_row("a")
    with pytest.raises(ValueError, match="min_match <= max_match"):
        LookupProposer(min_match=4, max_match=3)
    with pytest.raises(ValueError, match="history_policy"):
        LookupProposer(history_policy="best")
    with pytest.raises(ValueError, match="LookupHistory with max_match >= 8"):
        LookupProposer(LookupHistory(max_match=4))


# ---------------------------------------------------------------------------------------------------------
# Shared history
# ---------------------------------------------------------------------------------------------------------
def _finished_row(proposer: LookupProposer, row, prompt: list[int], output: list[int], **kwargs) -> None:
    proposer.start_row(row, prompt, **kwargs)
    proposer.commit(row, output)
    proposer.end_row(row, keep_in_history=True)


def test_history_is_scoped_by_key():
    history = LookupHistory(max_tokens=1000)
    secret = [50, 51, 52, 53, 54, 55, 56]
    _finished_row(LookupProposer(history, KEY_A), 0, [1, 2], secret)
    reader_a, reader_b = LookupProposer(history, KEY_A), LookupProposer(history, KEY_B)
    for reader in (reader_a, reader_b):
        reader.start_row(1, [9, 50, 51])
    assert reader_a.propose([1])[0] == LookupProposal((52, 53, 54, 55), 2, (1,) * 4, (1,) * 4, "history")
    assert reader_b.propose([1])[0] is NO_PROPOSAL  # key B never sees key A's text
    other_target = LookupHistoryKey("target-y", "tok-x", scope="user-a")
    reader_b.start_row(2, [9, 50, 51], history_key=other_target)  # per-row key: another target, same scope
    assert reader_b.propose([2])[0] is NO_PROPOSAL
    assert history.keys() == [KEY_A]


def test_disabled_or_absent_history_sees_nothing():
    output = [50, 51, 52, 53]
    for history, key in ((LookupHistory(enabled=False), KEY_A), (LookupHistory(max_tokens=0), KEY_A),
                         (LookupHistory(), None), (None, KEY_A)):
        _finished_row(LookupProposer(history, key), 0, [1], output)
        reader = LookupProposer(history, key)
        reader.start_row(1, [50, 51])
        assert reader.propose([1])[0] is NO_PROPOSAL, (history, key)
        if history is not None:
            assert history.num_tokens == 0 and history.keys() == []


def test_history_stores_generated_tokens_behind_a_short_prompt_lead_in():
    history = LookupHistory()
    proposer = LookupProposer(history, KEY_A, max_match=2)
    _finished_row(proposer, 0, [1, 2, 3, 4, 5, 6], [7, 8])
    assert history.num_tokens == 4  # the last max_match prompt tokens + the output
    proposer.start_row(1, [5, 6])
    assert proposer.propose([1])[0].tokens == (7, 8)
    proposer.start_row(2, [1, 2])
    assert proposer.propose([2])[0] is NO_PROPOSAL  # the early prompt was not stored
    _finished_row(proposer, 3, [1, 2], [], )  # nothing generated: nothing stored
    _finished_row(proposer, 4, [1, 2], [9], )
    proposer.start_row(5, [1])
    assert proposer.end_row(5, keep_in_history=False) is None and history.num_tokens == 4 + 3


def test_history_segments_do_not_join():
    history = LookupHistory()
    history.add(KEY_A, [1, 2, 3])
    history.add(KEY_A, [4, 5, 6])
    assert history.propose(KEY_A, [9, 3], 4) is NO_PROPOSAL  # 3 -> 4 would span two sequences
    assert history.propose(KEY_A, [9, 4], 4).tokens == (5, 6)


def test_history_eviction_keeps_the_token_budget():
    history = LookupHistory(max_tokens=100, num_generations=4)
    rng = random.Random(0)
    segments = []
    for i in range(60):
        segment = [1000 + i] + [rng.randrange(10_000, 20_000) for _ in range(rng.randint(1, 30))]
        history.add(KEY_A if i % 2 else KEY_B, segment)
        segments.append(segment)
        assert history.num_tokens <= 100
    assert history.propose(KEY_A, segments[-1][:1], 2).tokens == tuple(segments[-1][1:3])
    assert history.propose(KEY_B, segments[0][:1], 2) is NO_PROPOSAL  # evicted
    history.add(KEY_A, list(range(30_000, 30_500)))  # longer than the budget: only its tail is kept
    assert history.num_tokens == 100 and history.propose(KEY_A, [30_399], 1) is NO_PROPOSAL
    assert history.propose(KEY_A, [30_400], 1).tokens == (30_401,)
    history.clear(KEY_A)
    assert KEY_A not in history.keys() and history.num_tokens == sum(
        len(g) for k in history.keys() for g in history._shards[k])
    history.clear()
    assert history.num_tokens == 0 and history.keys() == []


def test_history_policy_fallback_vs_longest():
    history = LookupHistory()
    history.add(KEY_A, [1, 2, 3, 4, 5, 6])
    prompt = [7, 4, 8, 3, 4]  # own text: '4' -> 8 (n = 1); history: '3 4' -> 5 (n = 2)
    for policy, expected in (("fallback", ((8,), "row")), ("longest", ((5, 6), "history"))):
        proposer = LookupProposer(history, KEY_A, history_policy=policy)
        proposer.start_row(0, prompt)
        proposal = proposer.propose([0])[0]
        assert (proposal.tokens[:2] if policy == "longest" else proposal.tokens[:1], proposal.source) == expected


def test_history_keys_name_target_and_tokenizer():
    class Model:
        name_or_path = "org/model"

    first, second = Model(), Model()
    assert LookupHistoryKey.for_model(first) == LookupHistoryKey.for_model(first)
    assert LookupHistoryKey.for_model(first) != LookupHistoryKey.for_model(second)  # same checkpoint name
    assert LookupHistoryKey.for_model(first, scope="a") != LookupHistoryKey.for_model(first, scope="b")
    assert "org/model" in LookupHistoryKey.for_model(first).target
    old = LookupHistoryKey.for_model(first)
    del first
    gc.collect()
    assert all(LookupHistoryKey.for_model(Model()) != old for _ in range(5))  # no reuse after the object died
    with pytest.raises(TypeError, match="LookupHistoryKey"):
        LookupHistory().add("user-a", [1, 2])
    with pytest.raises(ValueError, match="non-empty target and tokenizer"):
        LookupHistoryKey("", "tok")


# ---------------------------------------------------------------------------------------------------------
# Calibrator
# ---------------------------------------------------------------------------------------------------------
def _synthetic_proposal(rng: random.Random, length: int = 8) -> LookupProposal:
    match = rng.randint(1, 9)
    counts = tuple(rng.choice((1, 2, 5)) for _ in range(length))
    totals = tuple(c if rng.random() < 0.7 else 2 * c + 1 for c in counts)
    return LookupProposal(tuple(range(length)), match, counts, totals, rng.choice(("row", "history")))


def _true_rate(proposal: LookupProposal, j: int) -> float:
    """A rate per calibrator bucket (source, match, evidence, position): what it can represent exactly."""
    rate = 0.15 + 0.15 * match_bucket(proposal.match_length) - 0.03 * min(j, 4)
    rate -= 0.1 * (support_bucket(proposal.counts[j], proposal.totals[j]) in (3, 4))
    return min(max(rate + (0.05 if proposal.source == "row" else 0.0), 0.02), 0.98)


def test_calibrator_starts_at_its_prior():
    calibrator = LookupCalibrator()
    proposal = LookupProposal((1, 2, 3), 8, (1, 2, 1), (1, 5, 1))  # seen once, minority, seen once
    once, minority = DEFAULT_PRIOR[4], DEFAULT_PRIOR[4] * DEFAULT_SUPPORT_FACTOR[4]
    assert calibrator.confidences(proposal) == pytest.approx([once, minority, once])
    assert [match_bucket(n) for n in range(1, 12)] == [0, 1, 2, 2, 3, 3, 3, 4, 4, 4, 4]
    assert [support_bucket(*x) for x in ((1, 1), (3, 3), (4, 4), (2, 3), (1, 3), (0, 0))] == [0, 1, 2, 3, 4, 5]
    matrix = calibrator.confidence_matrix([proposal, NO_PROPOSAL], width=5)
    assert matrix.shape == (2, 5) and (matrix[0, 3:] == 0).all() and (matrix[1] == 0).all()


def test_calibrator_converges_to_the_true_rates_and_reports_its_ece():
    rng = random.Random(0)
    calibrator = LookupCalibrator(max_records=50_000)
    for _ in range(24_000):
        proposal = _synthetic_proposal(rng)
        verified = rng.randint(1, len(proposal))
        accepted = 0
        while accepted < verified and rng.random() < _true_rate(proposal, accepted):
            accepted += 1
        calibrator.observe(proposal, verified, accepted)
    # first drafts are always reached: every bucket there has data (~600 events per cell, binomial σ ≈ 0.02)
    errors = [abs(calibrator.confidences(p)[0] - _true_rate(p, 0)) for p in (_synthetic_proposal(rng)
                                                                         for _ in range(500))]
    assert sum(errors) / len(errors) < 0.03 and max(errors) < 0.1
    report = calibrator.report()
    print(f"lookup calibrator ECE: conditional {report.ece_conditional:.4f} (noise floor "
          f"{report.ece_conditional_noise_floor:.4f}), joint {report.ece_joint:.4f} (floor "
          f"{report.ece_joint_noise_floor:.4f}) over {report.num_rounds} rounds")
    assert report.num_rounds == 24_000 and report.num_reached > report.num_rounds
    assert report.ece_conditional < report.ece_conditional_noise_floor + 0.02
    assert report.ece_joint < report.ece_joint_noise_floor + 0.02
    assert report.mean_confidence == pytest.approx(report.acceptance_rate, abs=0.02)


def test_calibrator_counts_only_verified_and_reached_drafts():
    calibrator = LookupCalibrator()
    proposal = LookupProposal((1, 2, 3, 4), 2, (1,) * 4, (1,) * 4)
    calibrator.observe(proposal, num_verified=3, num_accepted=1)  # draft 1 accepted, 2 rejected, 3 unreached
    strength, prior = calibrator.prior_strength, DEFAULT_PRIOR[1]
    assert calibrator.rates("row")[match_bucket(2), support_bucket(1, 1)] == pytest.approx(
        (1 + strength * prior) / (2 + strength))  # parent: pooled over positions, 1 of 2 accepted
    events = calibrator.num_events("row")[match_bucket(2), support_bucket(1, 1)]
    assert events[:3].tolist() == [1.0, 1.0, 0.0] and events.sum() == 2
    assert calibrator.num_events("history").sum() == 0
    calibrator.observe(proposal, num_verified=0, num_accepted=0)
    assert calibrator.num_rounds == 1
    with pytest.raises(ValueError, match="num_accepted <= num_verified"):
        calibrator.observe(proposal, num_verified=2, num_accepted=3)
