"""Agent loops side by side: what a user who calls ``generate`` with default arguments gets, against the peers.

An agent calls ``generate`` turn after turn on a growing conversation, and the user feels every call. Two
workloads, each a conversation the target writes itself (greedy, batch 1):

* ``tool calls`` — held-out tool-calling scenarios (:data:`TOOL_SCENARIOS`, written for this benchmark and never
  tuned for): per tool a call turn (one JSON object) and an answer turn, 15-60 tokens each, where fixed per-call
  costs weigh most;
* ``long turns`` — the project's scripted agent (``agent_script.py``): plan, tool call, read, answer per user turn.

Arms, every generation run by each of them in rotating order on the same conversation, default arguments only:

    plain                  target.generate
    plain, loop kernels    target.generate inside hf-dspark's CPU kernels (``cpu_kernels.loop_kernels``)
    prompt lookup          transformers' prompt lookup (prompt_lookup_num_tokens=10)
    hf-dspark lookup only  assistant_model=draft, dspark_lookup="only"
    hf-dspark drafter only assistant_model=draft, dspark_lookup=False
    hf-dspark              assistant_model=draft

Each hf-dspark arm runs on a target object (and drafter) of its own: calls on one target share their lookup history
and caches by default, and an arm must never copy the reply another arm just wrote. Every output is checked
token-identical to plain. A repeat starts every arm from nothing (``hf_dspark.forget``), as a new process would.
"""

from __future__ import annotations

import copy
import json
import logging
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ..cpu_kernels import loop_kernels
from ..generation.integration import disable
from ..speculation.shared_state import forget
from .agent_script import STEPS, SYSTEM_PROMPT, TURNS, render_ids, step_message

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolUse:
    request: str  # what the user asks
    tool: str
    result: dict  # the tool's canned answer


@dataclass(frozen=True)
class ToolScenario:
    system: str
    uses: tuple[ToolUse, ...]


#: Held-out tool-calling scenarios: tools, requests and results no recipe or benchmark of this project used before.
TOOL_SCENARIOS = (
    ToolScenario(
        "You are a travel assistant with tools. Tools: search_flights(origin, destination, date), "
        "book_hotel(city, check_in, nights), get_exchange_rate(base, quote). To use a tool, reply with only a JSON "
        'object like {"tool": "<name>", "arguments": {...}}. After the tool result, answer the user briefly.',
        (ToolUse("Find me a flight from Lisbon to Oslo on June 3rd.", "search_flights",
                 {"flights": [{"airline": "Norse", "depart": "07:40", "arrive": "12:15", "price_eur": 189},
                              {"airline": "TAP", "depart": "13:05", "arrive": "17:50", "price_eur": 214}]}),
         ToolUse("Book a hotel in Oslo for three nights from June 3rd.", "book_hotel",
                 {"hotel": "Fjordview Inn", "check_in": "2027-06-03", "nights": 3, "total_nok": 4350,
                  "confirmation": "FV-88213"}),
         ToolUse("How many Norwegian kroner is one euro right now?", "get_exchange_rate",
                 {"base": "EUR", "quote": "NOK", "rate": 11.62}))),
    ToolScenario(
        "You are an office assistant with tools. Tools: lookup_contact(name), send_email(to, subject, body), "
        "set_reminder(time, text). To use a tool, reply with only a JSON object like "
        '{"tool": "<name>", "arguments": {...}}. After the tool result, answer the user briefly.',
        (ToolUse("What is Priya Raman's email address?", "lookup_contact",
                 {"name": "Priya Raman", "email": "priya.raman@northwind.example", "team": "Design"}),
         ToolUse("Email Priya that the design review moves to Thursday at 10.", "send_email",
                 {"status": "sent", "to": "priya.raman@northwind.example", "message_id": "m-55107"}),
         ToolUse("Remind me on Thursday at 9:30 to print the review slides.", "set_reminder",
                 {"status": "scheduled", "time": "Thursday 09:30", "text": "Print the review slides"}))),
)
TOOL_CALL_INSTRUCTION = "Call the right tool now. Reply with only the JSON object."
TOOL_ANSWER_INSTRUCTION = "Answer me in one sentence."
TOOL_STEPS = {"call": 40, "answer": 60}  # step -> max new tokens


def tool_call_generations(scenario: ToolScenario):
    """The scenario as a sequence of (message to add, step name, max new tokens): a call and an answer per tool."""
    for use in scenario.uses:
        yield {"role": "user", "content": f"{use.request} {TOOL_CALL_INSTRUCTION}"}, "call", TOOL_STEPS["call"]
        yield ({"role": "tool", "content": json.dumps({"tool": use.tool, "result": use.result})}, None, 0)
        yield {"role": "user", "content": TOOL_ANSWER_INSTRUCTION}, "answer", TOOL_STEPS["answer"]


def long_turn_generations(num_turns: int):
    for turn in TURNS[:num_turns]:
        for step, max_new in STEPS.items():
            yield step_message(step, turn), step, max_new


@dataclass
class Arm:
    """One way of generating: its ``generate`` keywords (``assistant_model=True`` stands for the arm's drafter),
    whether it runs inside hf-dspark's CPU kernels, and its own target (hf-dspark arms) or the shared one."""

    name: str
    kwargs: dict = field(default_factory=dict)
    kernels: bool = False
    target: object = None
    drafter: object = None

    @property
    def speculative(self) -> bool:
        return bool(self.kwargs.get("assistant_model"))


DEFAULT_ARMS = (Arm("plain"), Arm("plain, loop kernels", kernels=True),
                Arm("prompt lookup", {"prompt_lookup_num_tokens": 10}),
                Arm("hf-dspark lookup only", {"assistant_model": True, "dspark_lookup": "only"}),
                Arm("hf-dspark drafter only", {"assistant_model": True, "dspark_lookup": False}),
                Arm("hf-dspark", {"assistant_model": True}))


def prepare_arms(target, drafter, arms=DEFAULT_ARMS) -> list[Arm]:
    """Fresh arms: speculative ones get a copy of the target and a drafter bound to it (nothing shared)."""
    prepared = []
    for arm in arms:
        arm = copy.copy(arm)
        arm.kwargs = dict(arm.kwargs)
        if arm.speculative:
            arm.target = copy.deepcopy(target)
            disable(arm.target)  # the copied generate wrapper would call the original target; binding re-installs it
            arm.drafter = copy.deepcopy(drafter).bind_target(arm.target)
            arm.kwargs["assistant_model"] = arm.drafter
        else:
            arm.target = target
        prepared.append(arm)
    return prepared


def generate_ids(arm: Arm, tokenizer, messages: list[dict], max_new_tokens: int) -> tuple[list[int], float]:
    """One call as an agent makes it (templating included): the new token ids and the wall time."""
    start = time.perf_counter()
    ids = torch.tensor([render_ids(tokenizer, messages)])
    with loop_kernels(arm.target) if arm.kernels else nullcontext():
        out = arm.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=tokenizer.eos_token_id, **arm.kwargs)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start


def run_conversation(arms: list[Arm], tokenizer, system: str, generations, rotation: int = 0) -> list[dict]:
    """One conversation, every generation by every arm (rotating order); the history continues on plain's reply."""
    messages = [{"role": "system", "content": system}]
    rows = []
    for index, (message, step, max_new) in enumerate(generations):
        messages.append(message)
        if step is None:  # a tool result: nothing to generate
            continue
        order = arms[(index + rotation) % len(arms):] + arms[:(index + rotation) % len(arms)]
        results = {arm.name: generate_ids(arm, tokenizer, messages, max_new) for arm in order}
        reference = results[arms[0].name][0]
        text = tokenizer.decode(reference, skip_special_tokens=True)
        rows.append({"step": step, "tokens": len(reference), "text": text,
                     "seconds": {name: s for name, (_, s) in results.items()},
                     "identical": {name: ids == reference for name, (ids, _) in results.items()}})
        messages.append({"role": "assistant", "content": text})
    return rows


def run_workloads(target, tokenizer, drafter, *, long_turns: int = 2, arms=DEFAULT_ARMS,
                  repeat: int = 0) -> dict[str, list[dict]]:
    """Both workloads once, every arm starting from nothing; rows per workload."""
    prepared = prepare_arms(target, drafter, arms)
    try:
        tool_rows = []
        for number, scenario in enumerate(TOOL_SCENARIOS):
            tool_rows += run_conversation(prepared, tokenizer, scenario.system, tool_call_generations(scenario),
                                          rotation=repeat + number)
        workloads = {"tool calls": tool_rows}
        if long_turns:
            workloads["long turns"] = run_conversation(prepared, tokenizer, SYSTEM_PROMPT,
                                                       long_turn_generations(long_turns), rotation=repeat)
        return workloads
    finally:
        for arm in prepared:
            if arm.speculative:
                forget(arm.target)


def summarize(repeats: list[dict[str, list[dict]]], arm_names: list[str]) -> dict:
    """Per workload and arm: seconds per repeat, the median, speedups over plain and prompt lookup, identity."""
    summary = {}
    for workload in repeats[0]:
        per_arm = {}
        for name in arm_names:
            seconds = [sum(r["seconds"][name] for r in rows[workload]) for rows in repeats]
            per_arm[name] = {"seconds": seconds, "median_s": statistics.median(seconds),
                             "identical": all(r["identical"][name] for rows in repeats for r in rows[workload])}
        plain, lookup = per_arm[arm_names[0]]["median_s"], per_arm.get("prompt lookup", {}).get("median_s")
        for name, stats in per_arm.items():
            stats["vs_plain"] = [p / s for p, s in zip(per_arm[arm_names[0]]["seconds"], stats["seconds"])]
            stats["speedup_vs_plain"] = plain / stats["median_s"]
            if lookup is not None:
                stats["vs_prompt_lookup"] = [p / s for p, s in zip(per_arm["prompt lookup"]["seconds"],
                                                                  stats["seconds"])]
                stats["speedup_vs_prompt_lookup"] = lookup / stats["median_s"]
        rows = repeats[0][workload]
        summary[workload] = {"generations": len(rows), "tokens": [r["tokens"] for r in rows], "arms": per_arm}
    return summary


def table(summary: dict) -> str:
    """A markdown table: per workload and arm, median seconds, speedups (each repeat in brackets), identity."""
    lines = ["| workload | arm | s (median) | × plain (repeats) | × prompt lookup (repeats) | identical |",
             "|---|---|---|---|---|---|"]
    for workload, data in summary.items():
        for name, s in data["arms"].items():
            reps = " / ".join(f"{v:.2f}" for v in s["vs_plain"])
            lookup = " / ".join(f"{v:.2f}" for v in s.get("vs_prompt_lookup", []))
            lines.append(f"| {workload} ({data['generations']} calls, {min(data['tokens'])}-{max(data['tokens'])} "
                         f"tokens) | {name} | {s['median_s']:.2f} | **{s['speedup_vs_plain']:.2f}** ({reps}) | "
                         f"**{s.get('speedup_vs_prompt_lookup', float('nan')):.2f}** ({lookup}) | "
                         f"{'yes' if s['identical'] else 'NO'} |")
    return "\n".join(lines)


__all__ = ["DEFAULT_ARMS", "TOOL_SCENARIOS", "Arm", "ToolScenario", "ToolUse", "prepare_arms", "run_conversation",
           "run_workloads", "summarize", "table"]
