"""Prefix caching across generate calls of one scope: a conversation's next turn prefills only its new tokens, the
output stays plain greedy's (and plain sampling's distribution), and nothing is kept or shared without a scope."""

from __future__ import annotations

import pytest
import torch
from conftest import flat_cost, make_tiny_drafter, make_tiny_llama
from scipy.stats import chi2_contingency

from hf_dspark import DSparkDraftModel
from hf_dspark.speculation.shared_state import forget, shared_state_for
from hf_dspark.speculation.prefix_cache import MIN_REUSED_TOKENS, PrefixCacheStore, common_prefix_length


@pytest.fixture(scope="module")
def target():
    model = make_tiny_llama(seed=5)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def draft(target):
    return make_tiny_drafter(target, seed=4, block_size=4, markov_rank=8)


def generate(target, ids: list[int], **kwargs) -> list[int]:
    x = torch.tensor([ids])
    out = target.generate(x, attention_mask=torch.ones_like(x), pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


def conversation(target, draft, turns: int, **kwargs) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """An agent-like loop: each prompt is the previous prompt + its reply + a new message; returns the prompts,
    the replies (hf-dspark) and the prompt tokens each call reused."""
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 96, (40,), generator=g).tolist()
    prompts, replies, reused = [], [], []
    for _ in range(turns):
        prompts.append(prompt)
        replies.append(generate(target, prompt, assistant_model=draft, max_new_tokens=12, **kwargs))
        reused.append(draft.stats.reused_prompt_tokens)
        prompt = prompt + replies[-1] + torch.randint(3, 96, (9,), generator=g).tolist()
    return prompts, replies, reused


def test_a_scope_reuses_the_previous_turn_and_output_stays_plain(target, draft):
    forget(target)
    prompts, replies, reused = conversation(target, draft, 4, do_sample=False, dspark_cache_salt="agent-1",
                                            dspark_step_cost=flat_cost())
    for prompt, reply in zip(prompts, replies):
        assert reply == generate(target, prompt, do_sample=False, max_new_tokens=12)
    assert reused[0] == 0
    # every later turn reuses the whole previous prompt and all of the previous reply whose K/V was written
    # (the last committed token is the anchor: its K/V is not in the cache yet)
    for prev, reply, got in zip(prompts, replies, reused[1:]):
        assert got == len(prev) + len(reply) - 1
    assert draft.stats.prompt_tokens == len(prompts[-1])


def test_a_default_conversation_reuses_its_prefix_and_isolated_calls_keep_nothing(target, draft):
    """No keyword at all: an agent's successive calls share the target's default scope, so each turn prefills only
    what is new. ``dspark_isolate=True`` (or ``dspark_prefix_cache=False``) keeps nothing."""
    forget(target)
    prompts, replies, reused = conversation(target, draft, 3, do_sample=False, dspark_step_cost=flat_cost())
    for prompt, reply in zip(prompts, replies):
        assert reply == generate(target, prompt, do_sample=False, max_new_tokens=12)
    assert reused[0] == 0
    assert reused[1:] == [len(prev) + len(reply) - 1 for prev, reply in zip(prompts[:-1], replies[:-1])]
    for kwargs in ({"dspark_isolate": True}, {"dspark_prefix_cache": False}):
        forget(target)
        _, _, reused = conversation(target, draft, 3, do_sample=False, dspark_step_cost=flat_cost(), **kwargs)
        assert reused == [0, 0, 0] and len(shared_state_for(target).prefixes) == 0


def test_two_conversations_of_one_salt_each_reuse_their_own_prefix(target, draft):
    forget(target)
    kwargs = dict(do_sample=False, max_new_tokens=8, assistant_model=draft, dspark_step_cost=flat_cost())
    first, second = list(range(3, 43)), list(range(50, 90))
    replies = [generate(target, prompt, **kwargs) for prompt in (first, second)]
    for prompt, reply in zip((first, second), replies):
        generate(target, prompt + reply + [7, 8, 9], **kwargs)
        assert draft.stats.reused_prompt_tokens == len(prompt) + len(reply) - 1


def test_scopes_do_not_share_and_a_diverging_prompt_reuses_only_the_common_part(target, draft):
    forget(target)
    kwargs = dict(do_sample=False, max_new_tokens=12, assistant_model=draft, dspark_step_cost=flat_cost())
    prompt = list(range(3, 63))
    generate(target, prompt, dspark_cache_salt="alice", **kwargs)
    generate(target, prompt + [70, 71], dspark_cache_salt="bob", **kwargs)
    assert draft.stats.reused_prompt_tokens == 0  # alice's caches are not bob's
    edited = prompt[:30] + [90] * 40
    got = generate(target, edited, dspark_cache_salt="alice", **kwargs)
    assert draft.stats.reused_prompt_tokens == 30
    assert got == generate(target, edited, do_sample=False, max_new_tokens=12)


def test_sampling_with_a_reused_prefix_keeps_the_distribution(target, draft):
    """χ² per position: second-turn samples with the first turn's caches reused vs plain sampling."""
    forget(target)
    first = list(range(3, 43))
    counts = {"plain": [], "reused": []}
    for i in range(300):
        torch.manual_seed(i)
        reply = generate(target, first, assistant_model=draft, do_sample=True, max_new_tokens=3,
                         dspark_cache_salt=f"s{i}", dspark_step_cost=flat_cost())
        second = first + reply + [50, 51]
        torch.manual_seed(10_000 + i)
        counts["reused"].append(generate(target, second, assistant_model=draft, do_sample=True, max_new_tokens=3,
                                         dspark_cache_salt=f"s{i}", dspark_step_cost=flat_cost()))
        assert draft.stats.reused_prompt_tokens == len(first) + len(reply) - 1
        torch.manual_seed(20_000 + i)
        counts["plain"].append(generate(target, second, do_sample=True, max_new_tokens=3))
    forget(target)
    # the second prompt differs per sample; pool positions by the token drawn (the statistic per position)
    for pos in range(3):
        a = torch.bincount(torch.tensor([c[pos] for c in counts["plain"]]), minlength=96)
        b = torch.bincount(torch.tensor([c[pos] for c in counts["reused"]]), minlength=96)
        table = torch.stack([a, b])
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table.numpy())[1] > 1e-3


def test_store_is_bounded_and_takes_what_the_prompt_shares():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2 and common_prefix_length([1], [1, 2]) == 1
    store = PrefixCacheStore(max_entries=2, max_bytes=2**30)
    assert store.take("k", list(range(50))) is None
    target = make_tiny_llama(seed=0)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8).eval()
    for key in ("a", "b", "c"):
        ids = torch.arange(3, 3 + 2 * MIN_REUSED_TOKENS)[None]
        target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, max_new_tokens=4,
                        do_sample=False, pad_token_id=0, dspark_cache_salt=key, dspark_step_cost=flat_cost())
    prefixes = shared_state_for(target).prefixes
    assert len(prefixes) == 3  # the target's own store (8 entries)
    _, entry = next(iter(prefixes._entries.values()))
    store.put("a", entry)
    short = list(range(3, 3 + MIN_REUSED_TOKENS - 1)) + [99]
    assert store.take("a", short) is None  # too short a common prefix: prefilled afresh (and the entry is gone)
    assert len(store) == 0
    entries = [entry for _, entry in prefixes._entries.values()]
    for key, entry in zip("xyz", entries):
        store.put(key, entry)
    assert len(store) == 2 and "x" not in store.keys()  # least recently used evicted past max_entries
    store.max_bytes = max(e.num_bytes for e in entries)  # room for one entry only (they are the same size)
    store.put("w", entries[0])
    assert store.keys() == ["w"] and store.num_bytes <= store.max_bytes
    store.max_bytes = 0
    store.put("v", entries[1])
    assert "v" not in store.keys()  # larger than the whole budget: not kept


def test_changed_weights_are_never_served_from_the_cache():
    """An in-place update of the target's weights (an optimizer step, load_state_dict) between two calls of a scope
    makes the cached K/V stale: the next call prefills afresh and equals plain greedy of the new weights."""
    model = make_tiny_llama(seed=7)
    model.generation_config.eos_token_id = None
    drafter = DSparkDraftModel.from_target(model, num_layers=1, block_size=4, markov_rank=8).eval()
    kwargs = dict(do_sample=False, max_new_tokens=8, assistant_model=drafter, dspark_cache_salt="s",
                  dspark_step_cost=flat_cost())
    prompt = list(range(3, 43))
    reply = generate(model, prompt, **kwargs)
    with torch.no_grad():
        model.get_decoder().layers[0].mlp.down_proj.weight.mul_(1.5)
    follow_up = prompt + reply + [7, 8]
    got = generate(model, follow_up, **kwargs)
    assert drafter.stats.reused_prompt_tokens == 0
    assert got == generate(model, follow_up, do_sample=False, max_new_tokens=8)
    generate(model, follow_up + got + [9], **kwargs)
    assert drafter.stats.reused_prompt_tokens > 0  # unchanged weights since the last call: reused again


def test_lookup_only_calls_keep_their_own_entries_and_reuse_them(target, draft):
    """A lookup-only call builds no drafter context: its caches are kept under the drafter-less key (a drafting call
    must never take a drafter context that stops at that call's prompt) and its next turn reuses them."""
    forget(target)
    prompts, replies, reused = conversation(target, draft, 3, do_sample=False, dspark_lookup="only",
                                            dspark_step_cost=flat_cost())
    for prompt, reply in zip(prompts, replies):
        assert reply == generate(target, prompt, do_sample=False, max_new_tokens=12)
    assert reused[1:] == [len(prev) + len(reply) - 1 for prev, reply in zip(prompts[:-1], replies[:-1])]
    state = shared_state_for(target)
    assert state.prefixes.keys() == [state.prefix_key(None, None)]  # never the drafting calls' key
    generate(target, prompts[-1] + replies[-1] + [5, 6, 7], assistant_model=draft, do_sample=False,
             max_new_tokens=4, dspark_step_cost=flat_cost())
    assert draft.stats.reused_prompt_tokens == 0  # the drafting call found no entry of its own


def test_a_call_in_flight_when_its_target_is_forgotten_leaves_nothing_behind(target, draft):
    """``forget(target)`` (or ``hf_dspark.disable``) from another thread while a call runs: the call goes on with the
    state it started with (one round lock with the calls sharing its scheduler) and leaves neither caches nor lookup
    history in what the target remembers from then on."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class ForgetOnce(StoppingCriteria):  # stands in for another thread: runs mid-call, after the prefill
        called = False

        def __call__(self, input_ids, scores, **kwargs):
            if not self.called:
                self.called = True
                forget(target)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    forget(target)
    prompt = list(range(3, 43))
    got = generate(target, prompt, assistant_model=draft, do_sample=False, max_new_tokens=8,
                   dspark_step_cost=flat_cost(), stopping_criteria=StoppingCriteriaList([ForgetOnce()]))
    assert got == generate(target, prompt, do_sample=False, max_new_tokens=8)
    state = shared_state_for(target)
    assert len(state.prefixes) == 0 and state.history.keys() == []
