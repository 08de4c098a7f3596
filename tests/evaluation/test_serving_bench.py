"""evaluation.serving_bench (``hf-dspark serve-bench``): policy labels, a closed-loop run on a tiny target, medians
over repeats and the printed table."""

from __future__ import annotations

import json

import pytest

from hf_dspark.evaluation.serving_bench import (ServingBenchSettings, median_over_repeats, parse_policy,
                                                run_serving_bench, serving_prompts, summary_table)


class StepClock:
    """A fake clock for :class:`ClosedLoop`: it stands still except while an engine it was attached to steps, and
    each step of that engine advances it by the seconds given for it. Timings become exact counts of steps."""

    def __init__(self):
        self.time = 0.0
        self.steps: dict[int, int] = {}  # id(engine) -> steps it ran

    def __call__(self) -> float:
        return self.time

    def attach(self, engine, seconds_per_step: float):
        step = engine.step

        def timed_step():
            self.time += seconds_per_step
            self.steps[id(engine)] = self.steps.get(id(engine), 0) + 1
            return step()

        engine.step = timed_step
        return engine


def test_policy_labels():
    assert parse_policy("fixed3", 0.4) == ("fixed", {"num_tokens": 3}, {})
    assert parse_policy("threshold", 0.4) == ("threshold", {"threshold": 0.4}, {})
    assert parse_policy("scheduled-async", 0.4) == ("scheduled-async", {}, {})
    assert parse_policy("lookup-only", 0.4) == ("scheduled", {}, {"lookup": True, "drafter": None})
    assert parse_policy("scheduled-nolookup", 0.4) == ("scheduled", {}, {"lookup": False})


def test_closed_loop_levels_repeats_and_medians(tiny_target, tiny_drafter):
    prompts = [("gsm8k", [5, 17, 33]), ("mt-bench", [8, 9]), ("humaneval", [40, 41, 42, 43])]
    settings = ServingBenchSettings(levels=[1, 2], policies=["none", "fixed2"], max_new_tokens=6, requests_factor=1,
                                    min_requests=3, repeats=2)
    sps = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3}
    results = run_serving_bench(tiny_target, tiny_drafter, None, prompts, sps, settings)
    assert [(r["concurrency"], r["repeat"]) for r in results] == [(1, 0), (1, 0), (1, 1), (1, 1), (2, 0), (2, 0),
                                                                 (2, 1), (2, 1)]
    assert [r["policy"] for r in results[:4]] == ["none", "fixed2", "fixed2", "none"]  # order rotated per repeat
    assert all(r["num_requests"] == 3 and r["generated_tokens"] == 18 for r in results)
    assert all(r["greedy_agreement"] == 1.0 for r in results[1:4])  # greedy: every policy, the same tokens
    summary = median_over_repeats(results)
    assert len(summary) == 4 and all(s["repeats"] == 2 and len(s["throughput_runs"]) == 2 for s in summary)
    table = summary_table(summary, settings.policies, settings.levels)
    assert table.splitlines()[2].startswith("1    |") and len(table.splitlines()) == 4
    json.dumps(summary)


def test_length_spread_serves_every_policy_the_same_stream(tiny_target, tiny_drafter):
    """--min-new-tokens: request i asks for a seeded draw from [min, max]; every policy and repeat gets the same
    lengths (and, greedy, the same tokens), and the lengths differ, so plain decoding is no longer in lock-step."""
    from hf_dspark.evaluation.serving_bench import request_length

    lengths = [request_length(i, 2, 9) for i in range(6)]
    assert lengths == [request_length(i, 2, 9) for i in range(6)] and len(set(lengths)) > 1
    assert all(2 <= n <= 9 for n in lengths) and request_length(3, None, 9) == 9 and request_length(3, 9, 9) == 9
    prompts = [("gsm8k", [5, 17, 33]), ("mt-bench", [8, 9])]
    settings = ServingBenchSettings(levels=[2], policies=["none", "fixed2"], max_new_tokens=9, min_new_tokens=2,
                                    requests_factor=1, min_requests=6, repeats=2)
    results = run_serving_bench(tiny_target, tiny_drafter, None, prompts, {1: 1.0, 2: 1.05, 4: 1.1}, settings)
    assert all(r["generated_tokens"] == sum(lengths) for r in results)
    assert all(r["greedy_agreement"] == 1.0 for r in results[1:])


def test_prompts_interleave_benchmarks_and_skip_long_ones(tmp_path):
    for name in ("gsm8k", "humaneval", "mt-bench"):
        rows = [{"turns": [f"{name} " + "x " * n]} for n in (1, 50, 2, 3)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    class Tokenizer:
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
            return list(range(len(messages[0]["content"].split())))

    prompts = serving_prompts(Tokenizer(), tmp_path, per_benchmark=2, max_prompts=None, max_prompt_tokens=10)
    assert [name for name, _ in prompts] == ["gsm8k", "humaneval", "mt-bench"] * 2
    assert all(len(ids) <= 10 for _, ids in prompts)
    assert len(serving_prompts(Tokenizer(), tmp_path, 2, max_prompts=4, max_prompt_tokens=10)) == 4
    with pytest.raises(FileNotFoundError, match="HF_DSPARK_EVAL_DIR"):
        serving_prompts(Tokenizer(), tmp_path / "none", 2, None, 10)


def test_full_load_window_ends_when_a_slot_first_goes_idle(tiny_target, tiny_drafter):
    """3 equal requests at C = 2 under plain steps: the first two finish together, the third then runs alone, so
    the full-load window holds exactly the first two requests' tokens (and ends before the run does)."""
    from hf_dspark.evaluation.serving_bench import ClosedLoop
    from hf_dspark.serving import DSparkEngine

    clock = StepClock()  # one second per engine step: the windows are counts of steps
    engine = clock.attach(DSparkEngine(tiny_target, None, "none", max_running_requests=2), 1.0)
    loop = ClosedLoop(engine, [("a", [5, 17, 33]), ("b", [8, 9, 10])], concurrency=2, num_requests=3,
                      max_new_tokens=6, sampling={}, now=clock)
    while not loop.done:
        loop.advance()
    record = loop.record()
    assert record["generated_tokens"] == 18
    assert record["full_load_tokens"] == 12
    assert record["wall_s"] == clock.steps[id(engine)]
    assert 0 < record["full_load_s"] < record["wall_s"] and record["full_load_s"] == int(record["full_load_s"])
    assert record["full_load_throughput"] == pytest.approx(12 / record["full_load_s"])


def test_lock_step_arms_keep_their_own_clocks_and_outputs(tiny_target, tiny_drafter):
    """Interleaved loops serve the same tokens as loops run one after another, and an arm's clock holds only its
    own steps: slowing one engine's steps does not slow the other arm's numbers (one clock for both arms that only
    the engines' steps advance, the slow arm's by 50 ms a step, the fast arm's by 1 ms)."""
    from hf_dspark.evaluation.serving_bench import ClosedLoop, run_interleaved, run_level
    from hf_dspark.serving import DSparkEngine

    prompts = [("a", [5, 17, 33]), ("b", [8, 9, 10]), ("c", [40, 41])]
    sps = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3}
    alone = run_level(DSparkEngine(tiny_target, tiny_drafter, "fixed", policy_kwargs={"num_tokens": 2}, sps=sps,
                                   max_running_requests=2), prompts, 2, 4, 6, {})
    clock = StepClock()
    slow = clock.attach(DSparkEngine(tiny_target, None, "none", max_running_requests=2), 0.05)
    fast = clock.attach(DSparkEngine(tiny_target, tiny_drafter, "fixed", policy_kwargs={"num_tokens": 2}, sps=sps,
                                     max_running_requests=2), 0.001)
    records = run_interleaved([ClosedLoop(slow, prompts, 2, 4, 6, {}, now=clock),
                               ClosedLoop(fast, prompts, 2, 4, 6, {}, now=clock)])
    assert [r["outputs"] for r in records] == [alone["outputs"]] * 2  # greedy: the same tokens every way
    slow_record, fast_record = records
    assert slow_record["wall_s"] == pytest.approx(0.05 * clock.steps[id(slow)])  # its own steps, nothing else
    assert fast_record["wall_s"] == pytest.approx(0.001 * clock.steps[id(fast)])
    assert slow_record["wall_s"] >= 0.05 * slow_record["decode_steps"]
    assert fast_record["wall_s"] < 0.05 * slow_record["decode_steps"] / 2  # none of the slow arm's steps
    assert fast_record["throughput"] == pytest.approx(fast_record["generated_tokens"] / fast_record["wall_s"])
    assert all(r["per_user_tps"] > 0 and 0 < r["mean_ttft_s"] <= r["wall_s"] for r in records)


def test_step_kinds_account_for_every_decode_step_and_token(tiny_target, tiny_drafter):
    from hf_dspark.evaluation.serving_bench import run_level
    from hf_dspark.serving import DSparkEngine

    sps = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3}
    for policy, kwargs, kinds in (("none", {}, {"plain"}), ("fixed", {"num_tokens": 2}, {"drafted"})):
        engine = DSparkEngine(tiny_target, tiny_drafter if policy != "none" else None, policy, policy_kwargs=kwargs,
                              sps=sps, max_running_requests=2)
        record = run_level(engine, [("a", [5, 17, 33]), ("b", [8, 9, 10])], 2, 3, 6, {})
        steps = record["step_kinds"]
        assert kinds <= set(steps) <= {"plain", "drafted", "drafted, nothing verified"}
        assert sum(e["steps"] for e in steps.values()) == record["decode_steps"]
        # every token but each request's first (its prefill picks that one)
        assert sum(e["tokens"] for e in steps.values()) == record["generated_tokens"] - 3 == 15
        assert all(e["seconds"] > 0 and e["rows"] >= e["steps"] for e in steps.values())


def test_interleave_setting_is_checked(tiny_target, tiny_drafter):
    settings = ServingBenchSettings(levels=[1], policies=["none"], max_new_tokens=2, interleave="sometimes")
    with pytest.raises(ValueError, match="interleave"):
        run_serving_bench(tiny_target, tiny_drafter, None, [("a", [5, 6])], {1: 1.0}, settings)


class WordTokenizer:
    """Words <-> ids of a tiny vocabulary (a stable hash per word), chat "template" = the messages' words in order:
    enough for an agent's conversation to grow with its replies, which is what the agent workload exercises."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def _id(self, word: str) -> int:
        return 3 + sum(map(ord, word)) % (self.vocab_size - 3)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        words = [w for m in messages for w in (m["role"] + " " + m["content"]).split()]
        return [self._id(w) for w in words]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


def test_scripted_agent_alternates_requests_and_replies():
    from hf_dspark.evaluation.agent_script import STEPS, SYSTEM_PROMPT, TURNS, ScriptedAgent

    agent = ScriptedAgent(num_turns=2, first_turn=len(TURNS) - 1)  # the script wraps around
    assert agent.num_generations == 2 * len(STEPS)
    messages, max_new = agent.next_request()
    assert messages == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": TURNS[-1].user}]
    assert max_new == STEPS["plan"]
    with pytest.raises(RuntimeError, match="no reply yet"):
        agent.next_request()
    agent.reply("I will check.")
    messages, max_new = agent.next_request()
    assert messages[-2] == {"role": "assistant", "content": "I will check."} and max_new == STEPS["tool_call"]
    while True:
        agent.reply("ok")
        if agent.done:
            break
        messages, _ = agent.next_request()
    assert messages[-1]["content"] != TURNS[-1].user and TURNS[0].user in [m["content"] for m in messages]
    assert len(agent.messages) == 1 + 2 * agent.num_generations
    with pytest.raises(RuntimeError, match="script is over"):
        agent.next_request()


def test_agent_workload_serves_each_agent_its_own_growing_conversation(tiny_target, tiny_drafter):
    """--workload agents: C agents, each request re-reading its agent's conversation (replies included), one lookup
    scope per agent; every policy gives the same greedy tokens per (agent, generation) index."""
    from hf_dspark.evaluation.agent_script import STEPS
    from hf_dspark.evaluation.serving_bench import AgentClosedLoop
    from hf_dspark.serving import DSparkEngine

    tokenizer = WordTokenizer(tiny_target.config.vocab_size)
    settings = ServingBenchSettings(levels=[2], policies=["none", "scheduled"], workload="agents", agent_turns=1,
                                    repeats=1)
    results = run_serving_bench(tiny_target, tiny_drafter, tokenizer, [], {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3},
                                settings)
    generations = 2 * len(STEPS)
    assert [r["num_requests"] for r in results] == [generations, generations]
    assert results[1]["greedy_agreement"] == 1.0
    assert all(r["generated_tokens"] <= 2 * sum(STEPS.values()) and r["full_load_s"] <= r["wall_s"]
               for r in results)

    # the requests an agent sends grow with its replies, and each carries the agent's own scope
    engine = DSparkEngine(tiny_target, None, "none", max_running_requests=2)
    sent = []
    submit = engine.submit
    engine.submit = lambda ids, n, **kw: (sent.append((list(ids), n, kw.get("cache_salt"))), submit(ids, n, **kw))[1]
    loop = AgentClosedLoop(engine, tokenizer, concurrency=2, turns_per_agent=1, sampling={})
    while not loop.done:
        loop.advance()
    by_scope = {}
    for ids, n, scope in sent:
        by_scope.setdefault(scope, []).append((ids, n))
    assert sorted(by_scope) == ["agent-0", "agent-1"]
    for requests in by_scope.values():
        assert [n for _, n in requests] == list(STEPS.values())
        assert all(len(later) > len(earlier) and later[:len(earlier)] == earlier  # the conversation so far, and more
                   for (earlier, _), (later, _) in zip(requests, requests[1:]))
    assert by_scope["agent-0"][0][0] != by_scope["agent-1"][0][0]  # they start at different scripted turns
