"""Admission and prefill as an object: FCFS admission within the padded reservation, prefills that hand back the
rows ready to join (a request finished by its first token never joins), and which prompts are prefilled together:
similar lengths in one left-padded forward, padding bounded."""

from __future__ import annotations

import torch
from conftest import make_tiny_llama

from hf_dspark.serving.admission import Admission, padding_aware_groups
from hf_dspark.serving.fault_isolation import DecodeQuarantine
from hf_dspark.serving.metrics import EngineMetrics
from hf_dspark.serving.requests import FinishReason, Request, SamplingParams


def test_admission_admits_within_the_reservation_and_hands_back_rows_ready_to_join():
    """Without an engine: two requests fit (max_running_requests = 2) and are prefilled in one forward; the one that
    ends at its first token is reported finished and does not join; the long one waits (2 rows × its 35-slot
    reservation exceed the 64 slots) until it is cancelled."""
    target = make_tiny_llama(seed=0)
    finished, metrics = [], EngineMetrics(1)
    admission = Admission(target, None, max_running_requests=2, max_batch_tokens=64, max_prefill_tokens=256,
                          max_proposal=0, quarantine=DecodeQuarantine(), prefixes=None, metrics=metrics,
                          on_finished=finished.append)
    first, one_token, long = [Request(ids, SamplingParams(max_new_tokens=n), set())
                              for ids, n in (([5, 9, 7], 4), ([8, 3], 1), ([40, 41, 42, 43], 30))]
    admission.add([first, one_token, long])
    admission.admit(running=[])
    assert admission.prefilling == [first, one_token] and list(admission.waiting) == [long]
    assert admission.reserved_slots(running=[]) == 2 * (3 + 4 + 1)
    with torch.no_grad():
        joining = admission.prefill(tap=None)
        greedy = [int(target(input_ids=torch.tensor([r.prompt_ids])).logits[0, -1].argmax())
                  for r in (first, one_token)]
    assert metrics.prefill_forwards == 1 and metrics.prefill_tokens == 5 and not admission.prefilling
    assert [group.requests for group in joining] == [[first]] and joining[0].anchors == [greedy[0]]
    assert first.tokens == [greedy[0]] and one_token.tokens == [greedy[1]]
    assert finished == [one_token] and one_token.finish_reason is FinishReason.LENGTH
    admission.admit(running=[first])
    assert list(admission.waiting) == [long] and admission.has_work
    long.cancel_requested = True
    assert admission.take_cancelled() == [long] and not admission.has_work


def test_similar_lengths_share_a_group_and_an_outlier_goes_alone():
    lengths = [120, 30, 100, 110, 400]
    groups = padding_aware_groups(lengths, max_tokens=4096)
    assert groups == [[1], [0, 2, 3], [4]]  # 100-120 padded by 30 of 330 tokens; 30 and 400 each alone


def test_short_prompts_are_grouped_despite_a_large_padding_fraction():
    """A forward's fixed cost is worth more than a few padded tokens: 3- and 9-token prompts go together."""
    assert padding_aware_groups([3, 9, 5], max_tokens=1024) == [[0, 1, 2]]


def test_the_padded_size_stays_within_the_token_budget():
    assert padding_aware_groups([50, 50, 50, 50], max_tokens=120) == [[0, 1], [2, 3]]  # 3 × 50 would be 150


def test_every_prompt_lands_in_exactly_one_group():
    lengths = [17, 3, 250, 64, 65, 66, 900, 12, 12, 300]
    groups = padding_aware_groups(lengths, max_tokens=2048)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        rows, widest, tokens = len(group), max(lengths[i] for i in group), sum(lengths[i] for i in group)
        assert rows * widest <= 2048
        assert rows * widest - tokens <= max(0.25 * tokens, 16 * (rows - 1))
