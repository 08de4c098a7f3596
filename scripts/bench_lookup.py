"""Micro-benchmark of the lookup proposer (``hf_dspark.speculation.lookup``): host cost per round and what it
would propose on the agent loop of ``scripts/bench_agent_loop.py``. No model runs: tokenizer only.

1. **Cost.** µs per round (one ``propose`` + one ``commit`` of the accepted drafts and the bonus token) for a row
   of 256 / 2,048 / 8,192 tokens, plus the one-off ``start_row`` cost per prompt token and memory per token;
   next to transformers' ``PromptLookupCandidateGenerator.get_candidates`` (a rescan) on the same rows.
2. **Proposals on agent-loop transcripts.** The conversation of ``bench_agent_loop.py`` (its system prompt, user
   turns, tool results and instructions, rendered with the SmolLM2 chat template) with assistant replies that are
   either *recorded* (``--transcripts``: the ``text`` of each step in an ``agent_loop.json``, real SmolLM2 greedy
   output) or *scripted* (written here from each turn's tool result: plan, JSON tool call, reading, answer; an
   assumption about how an agent copies, stated as such). Each reply is replayed as greedy decoding where the
   target emits exactly that reply: per round the proposer drafts, the longest agreeing prefix is accepted, and
   one more token (recovered/bonus) is committed. Reported per proposer: fraction of rounds with a proposal,
   mean proposal length, accepted drafts per round, τ (committed tokens per round, bonus included) when every
   draft is verified and when drafting stops where the calibrated survival a_j falls below ``--survival-cut``,
   and the calibrator's ECE. ``user 2`` is a second conversation after user 1's, in reverse turn order, to show
   what the shared history (earlier requests' outputs, same key) adds: scripted, its tool results carry other
   values (cities, numbers), so only the structure repeats; recorded, its replies are user 1's own texts (an
   upper bound: identical replies to repeated requests).

    python scripts/bench_lookup.py
    python scripts/bench_lookup.py --transcripts benchmarks/current/lookup/agent_loop_transcripts.json \\
        --out runs/bench_lookup
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import tracemalloc
from pathlib import Path

import hf_dspark.evaluation.agent_script as agent  # the agent loop's conversation
from hf_dspark.generation.chat import ChatSession
from hf_dspark.speculation.lookup import (NO_PROPOSAL, LookupHistory, LookupHistoryKey, LookupIndex,
                                         LookupProposal, LookupProposer)
from hf_dspark.speculation.lookup_calibration import LookupCalibrator

logger = logging.getLogger("bench_lookup")

ARGUMENT_KEYS = {"get_weather": ("city",), "get_calendar": ("date",),
                 "convert_currency": ("amount", "source", "target"), "calculator": ("expression",),
                 "search_docs": ("query",)}


def load_tokenizer():
    """The SmolLM2 tokenizer alone (from the converted cache, else straight from the shipped GGUF)."""
    from transformers import AutoTokenizer

    from hf_dspark.embedded import converted_target_dir, locate_gguf

    path = converted_target_dir()
    if (path / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(path)
    gguf = locate_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


SWAPS = {"Paris": "Lyon", "Madrid": "Rome", "EUR": "GBP", "US dollars": "yen", "USD": "JPY", "euros": "pounds",
         "Dentist": "Doctor", "dentist": "doctor", "Team sync": "Standup", "router": "modem", "March": "April"}


def perturbed(turn: agent.ScriptedTurn) -> agent.ScriptedTurn:
    """The same request from another user: other cities, currencies and numbers."""

    def swap(value):
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)):
            return round(value * 1.3 + 3, 2) if isinstance(value, float) else value + 3
        if isinstance(value, str):
            for old, new in SWAPS.items():
                value = value.replace(old, new)
            return value
        if isinstance(value, list):
            return [swap(v) for v in value]
        return {k: swap(v) for k, v in value.items()}

    return agent.ScriptedTurn(swap(turn.user), turn.tool, swap(turn.result))


def scripted_reply(step: str, turn: agent.ScriptedTurn) -> str:
    """What a tool-calling agent typically says at each step: it re-uses the tool's name, JSON keys and values."""
    result = turn.result
    arguments = {k: result.get(k, result.get("today", "")) for k in ARGUMENT_KEYS[turn.tool]}
    if step == "plan":
        return (f"To answer this, I will call the {turn.tool} tool with "
                + ", ".join(f"{k} {v}" for k, v in arguments.items()) + ", then use the result to answer.")
    if step == "tool_call":
        return json.dumps({"tool": turn.tool, "arguments": arguments})
    facts = ", ".join(f"{k} is {json.dumps(v)}" for k, v in result.items())
    if step == "read":
        return f"The {turn.tool} tool returned: {facts}."
    return f"According to the {turn.tool} tool, {facts}. I hope this answers your question."


def conversation(tokenizer, turns, replies: dict | None) -> list[tuple[str, list[int], list[int]]]:
    """(step, prompt ids, reply ids) for every generation of one agent-loop conversation."""
    session = ChatSession(None, tokenizer, None, system_prompt=agent.SYSTEM_PROMPT)
    out = []
    for index, turn in turns:
        for step in agent.STEPS:
            session.add_message(**agent.step_message(step, turn))
            prompt = session.prompt_ids()[0].tolist()
            text = replies.get((index, step)) if replies else None
            text = scripted_reply(step, turn) if text is None else text
            reply = tokenizer(text, add_special_tokens=False)["input_ids"][: agent.STEPS[step]]
            session.add_message("assistant", tokenizer.decode(reply))
            out.append((step, prompt, reply + [tokenizer.eos_token_id]))
    return out


def recorded_replies(path: str) -> tuple[dict, int]:
    report = json.loads(Path(path).read_text())
    replies = {(t["turn"] - 1, s["step"]): s["text"] for t in report["turns"] for s in t["steps"]}
    return replies, len(report["turns"])


class PromptLookupBaseline:
    """transformers' prompt lookup (``prompt_lookup_num_tokens=10``, n-gram ≤ 2, earliest match) behind the
    proposer's row API, so both run through the same replay."""

    def __init__(self, num_tokens: int = 10):
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

        self.generator = PromptLookupCandidateGenerator(num_output_tokens=num_tokens, max_length=10**9)
        self.rows: dict = {}

    def start_row(self, row, prompt):
        self.rows[row] = list(prompt)

    def commit(self, row, tokens):
        self.rows[row] += list(tokens)

    def end_row(self, row, keep_in_history=True):
        del self.rows[row]

    def propose(self, rows, max_tokens=None):
        import torch

        out = []
        for row in rows:
            ids = torch.tensor([self.rows[row]])
            candidates, _ = self.generator.get_candidates(ids)
            tokens = tuple(candidates[0, ids.shape[1]:].tolist())
            out.append(LookupProposal(tokens, 2, (1,) * len(tokens), (1,) * len(tokens)) if tokens else NO_PROPOSAL)
        return out


def replay(proposer, generations, calibrator: LookupCalibrator, block: int, survival_cut: float) -> dict:
    """Greedy replay of ``generations``; counts per round and calibrator updates (every draft is verified)."""
    rounds = proposed_rounds = drafted = accepted_total = committed = 0
    cut_committed = cut_verified = 0
    calibrator.clear_records()  # ECE of this replay's predictions (the counts carry over: online)
    sources: dict[str, list[int]] = {}
    for number, (_, prompt, reply) in enumerate(generations):
        proposer.start_row(number, prompt)
        position = 0
        while position < len(reply):
            (proposal,) = proposer.propose([number], max_tokens=block)
            tokens, target = proposal.tokens, reply[position:]
            accepted = next((i for i, (a, b) in enumerate(zip(tokens, target)) if a != b), min(len(tokens),
                                                                                                len(target)))
            conf = calibrator.confidences(proposal)
            survival, verified = 1.0, 0
            for c in conf:  # non-anticipating: a_j reads drafts < j only
                survival *= c
                if survival < survival_cut:
                    break
                verified += 1
            calibrator.observe(proposal, len(tokens), accepted)
            step = reply[position:position + accepted + 1]
            proposer.commit(number, step)
            position += len(step)
            rounds += 1
            committed += len(step)
            cut_committed += min(accepted, verified) + 1
            cut_verified += verified
            if tokens:
                proposed_rounds += 1
                drafted += len(tokens)
                accepted_total += accepted
                stats = sources.setdefault(proposal.source, [0, 0, 0])
                stats[0], stats[1], stats[2] = stats[0] + 1, stats[1] + len(tokens), stats[2] + accepted
        proposer.end_row(number, keep_in_history=True)
    report = calibrator.report(noise_floor_draws=100)
    return {"rounds": rounds, "tokens": committed, "proposal_rate": proposed_rounds / rounds,
            "mean_proposal_len": drafted / proposed_rounds if proposed_rounds else 0.0,
            "accepted_per_round": accepted_total / rounds, "acceptance": accepted_total / drafted if drafted else 0.0,
            "tau_full": committed / rounds, "tau_cut": cut_committed / rounds, "verified_cut": cut_verified / rounds,
            "by_source": {s: {"rounds": v[0], "drafted": v[1], "accepted": v[2]} for s, v in sources.items()},
            "ece_joint": report.ece_joint, "ece_joint_floor": report.ece_joint_noise_floor,
            "ece_conditional": report.ece_conditional, "ece_conditional_floor": report.ece_conditional_noise_floor}


def acceptance_tables(tokenizer, args) -> dict:
    replies, num_recorded = recorded_replies(args.transcripts) if args.transcripts else ({}, 0)
    turns = list(enumerate(agent.TURNS[: args.turns]))
    sets = {"scripted": None}
    if num_recorded:
        sets = {"recorded": replies, "scripted": None}
    results = {}
    for name, texts in sets.items():
        selected = turns[:num_recorded] if texts else turns
        user1 = conversation(tokenizer, selected, texts)
        user2 = conversation(tokenizer, [(i, t if texts else perturbed(t)) for i, t in selected[::-1]], texts)
        key = LookupHistoryKey("SmolLM2-135M-Instruct", "SmolLM2 tokenizer", scope="bench")
        arms = {"transformers prompt lookup": lambda: PromptLookupBaseline(),
                "lookup, no history": lambda: LookupProposer(max_tokens=args.block),
                "lookup + history (fallback)": lambda: LookupProposer(LookupHistory(), key, max_tokens=args.block,
                                                                      history_policy="fallback"),
                "lookup + history (longest)": lambda: LookupProposer(LookupHistory(), key, max_tokens=args.block)}
        for arm, make in arms.items():
            proposer, calibrator = make(), LookupCalibrator()
            row = {"user 1": replay(proposer, user1, calibrator, args.block, args.survival_cut)}
            row["user 2"] = replay(proposer, user2, calibrator, args.block, args.survival_cut)
            if isinstance(proposer, PromptLookupBaseline):  # no calibrated survival of its own: no cut, no ECE
                for stats in row.values():
                    stats.update({k: float("nan") for k in stats if k.startswith(("ece", "tau_cut", "verified_cut"))})
            results[f"{name} / {arm}"] = row
        logger.warning("%s: %d generations per user, %d reply tokens", name, len(user1),
                       sum(len(r) for _, _, r in user1))
    return results


def timing_table(tokenizer, args) -> dict:
    """µs per round at each row length, on the scripted conversation's token stream (realistic repetition).

    Every row ends at the same point P of the stream and the timed rounds continue from there with the same text,
    so rows differ only in how much context they hold; proposals are capped at ``--block`` for every match.
    ``+history``: the same rounds with a full 65,536-token history (``longest`` policy) behind the row."""
    stream = []
    for _, prompt, reply in conversation(tokenizer, list(enumerate(agent.TURNS)), None):
        stream += prompt[-600:] + reply  # the new part of each request, as one long agent trace
    end = max(args.lengths)
    if len(stream) < end + args.rounds * (args.block + 1):
        logger.warning("the agent trace has %d tokens; repeating it (later rounds see copies)", len(stream))
    history_text = stream[::-1]  # the history holds the trace backwards: big, similar tokens, few easy matches
    while len(stream) < end + args.rounds * (args.block + 1):
        stream += stream
    key = LookupHistoryKey("SmolLM2-135M-Instruct", "SmolLM2 tokenizer", scope="bench")
    history = LookupHistory(max_tokens=65_536)
    for _ in range(-(-80_000 // len(history_text))):  # more than the budget: eviction has run
        for i in range(0, len(history_text), 300):
            history.add(key, history_text[i:i + 300])
    baseline, calibrator = PromptLookupBaseline(), LookupCalibrator()
    out = {}
    for length in args.lengths:
        arms = {"plain": LookupProposer(max_tokens=args.block, long_match_tokens=args.block),
                "history": LookupProposer(history, key, max_tokens=args.block, long_match_tokens=args.block)}
        seconds = {"propose": 0.0, "commit": 0.0, "confidences": 0.0, "history_propose": 0.0, "transformers": 0.0}
        start = time.perf_counter()
        arms["plain"].start_row(0, stream[end - length:end])
        index_us = (time.perf_counter() - start) * 1e6 / length
        arms["history"].start_row(0, stream[end - length:end])
        baseline.start_row(0, stream[end - length:end])
        position, drafted = end, 0
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            (proposal,) = arms["plain"].propose([0])
            t1 = time.perf_counter()
            calibrator.confidences(proposal)
            t2 = time.perf_counter()
            arms["history"].propose([0])
            t3 = time.perf_counter()
            baseline.propose([0])
            t4 = time.perf_counter()
            accepted = next((i for i, (a, b) in enumerate(zip(proposal.tokens, stream[position:])) if a != b),
                            len(proposal))
            step = stream[position:position + accepted + 1]
            t5 = time.perf_counter()
            arms["plain"].commit(0, step)
            t6 = time.perf_counter()
            arms["history"].commit(0, step)
            baseline.commit(0, step)
            position += len(step)
            drafted += len(proposal)
            for name, dt in (("propose", t1 - t0), ("confidences", t2 - t1), ("history_propose", t3 - t2),
                             ("transformers", t4 - t3), ("commit", t6 - t5)):
                seconds[name] += dt
        tracemalloc.start()
        LookupIndex(8, stream[:length])
        memory = tracemalloc.get_traced_memory()[1] / length
        tracemalloc.stop()
        n, committed = args.rounds, position - end
        out[length] = {"round_us": (seconds["propose"] + seconds["commit"]) * 1e6 / n,
                       "propose_us": seconds["propose"] * 1e6 / n,
                       "commit_us_per_token": seconds["commit"] * 1e6 / committed,
                       "confidences_us": seconds["confidences"] * 1e6 / n,
                       "history_propose_us": seconds["history_propose"] * 1e6 / n,
                       "start_row_us_per_token": index_us, "mean_proposal_len": drafted / n, "bytes_per_token": memory,
                       "transformers_propose_us": seconds["transformers"] * 1e6 / n, "tokens_per_round": committed / n}
        baseline.end_row(0)
    return out


def reference_loop_ns(iterations: int = 100_000, repeats: int = 5) -> float:
    """ns per iteration of a bare loop (best of ``repeats``): how fast this interpreter runs right now."""
    best = float("inf")
    for _ in range(repeats):
        start, total = time.perf_counter(), 0
        for i in range(iterations):
            total += i
        best = min(best, time.perf_counter() - start)
    return best * 1e9 / iterations


def print_tables(timing: dict, acceptance: dict) -> None:
    print(f"\nµs per round (propose + commit), its parts, the calibrator's confidences, propose with a full history, "
          f"and transformers' prompt lookup on the same rows. Machine reference: {reference_loop_ns():.0f} ns per "
          f"iteration of a bare python loop (~10-20 ns on an idle core); scale by it")
    print(f"{'tokens':>6} | {'round µs':>8} | {'propose':>7} | {'drafts':>6} | {'commit/tok':>10} | "
          f"{'tok/round':>9} | {'conf µs':>7} | {'+history':>8} | {'start_row/tok':>13} | {'B/token':>7} | {'transformers PLD':>16}")
    for length, t in timing.items():
        print(f"{length:>6} | {t['round_us']:8.1f} | {t['propose_us']:7.1f} | {t['mean_proposal_len']:6.2f} | "
              f"{t['commit_us_per_token']:10.2f} | {t['tokens_per_round']:9.2f} | {t['confidences_us']:7.1f} | "
              f"{t['history_propose_us']:8.1f} | {t['start_row_us_per_token']:13.2f} | {t['bytes_per_token']:7.0f} | "
              f"{t['transformers_propose_us']:16.1f}")
    header = (f"{'transcripts / proposer':<46} | {'user':>6} | {'rounds':>6} | {'w/ prop':>7} | {'len':>5} | "
              f"{'acc/rnd':>7} | {'accept':>6} | {'τ full':>6} | {'τ cut':>5} | {'ver cut':>7} | "
              f"{'ECE joint':>9} | {'floor':>6} | {'ECE cond':>8} | {'floor':>6}")
    print("\n" + header + "\n" + "-" * len(header))
    for name, users in acceptance.items():
        for user, s in users.items():
            print(f"{name:<46} | {user:>6} | {s['rounds']:>6} | {s['proposal_rate']:7.0%} | "
                  f"{s['mean_proposal_len']:5.2f} | {s['accepted_per_round']:7.2f} | {s['acceptance']:6.0%} | "
                  f"{s['tau_full']:6.2f} | {s['tau_cut']:5.2f} | {s['verified_cut']:7.2f} | {s['ece_joint']:9.4f} | "
                  f"{s['ece_joint_floor']:6.4f} | {s['ece_conditional']:8.4f} | {s['ece_conditional_floor']:6.4f}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transcripts", default=None, help="agent_loop.json whose step texts are the replies (recorded)")
    p.add_argument("--turns", type=int, default=len(agent.TURNS), help="scripted user turns per conversation")
    p.add_argument("--block", type=int, default=8, help="drafts per proposal for short matches (block size)")
    p.add_argument("--survival-cut", type=float, default=0.3, help="τ cut: verify drafts while a_j >= this")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 2048, 8192])
    p.add_argument("--rounds", type=int, default=1000, help="timed rounds per length and repeat")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats (the minimum of each figure is reported)")
    p.add_argument("--out", default=None, help="directory for bench_lookup.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    tokenizer = load_tokenizer()
    # interference from other processes only ever adds time: keep each figure's minimum over the repeats
    runs = [timing_table(tokenizer, args) for _ in range(args.repeats)]
    timing = {length: {k: min(run[length][k] for run in runs) for k in runs[0][length]} for length in args.lengths}
    acceptance = acceptance_tables(tokenizer, args)
    print_tables(timing, acceptance)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_lookup.json").write_text(json.dumps({"config": vars(args), "timing": timing,
                                                           "acceptance": acceptance}, indent=2))
    median = statistics.median(t["round_us"] for t in timing.values())
    logger.warning("median %.1f µs per round over lengths %s", median, list(timing))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
