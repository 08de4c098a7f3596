"""The scripted multi-turn tool-calling agent every agent benchmark runs (``bench_agent_loop.py``, ``bench_fusion.py``,
``hf-dspark serve-bench --workload agents``): the product's own use case in one place, so the benchmarks measure the
same conversation.

Each user turn is answered with four generations on the growing conversation:

    1. plan       the agent says what it will do
    2. tool call  one JSON object {"tool": ..., "arguments": {...}}
    3. read       a canned tool result is added as a `tool` message; the agent states what it learned
    4. answer     the reply to the user

The target's replies are part of the history, so the conversation an agent has depends only on the target and the
decoding (greedy decoding: on nothing else; every lossless speculative arm sees the same one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SYSTEM_PROMPT = (
    "You are an assistant that can call tools. Tools: get_weather(city), search_docs(query), "
    "calculator(expression), get_calendar(date), convert_currency(amount, source, target). To call a tool, reply "
    'with only a JSON object: {"tool": "<name>", "arguments": {...}}. After a tool result, use it to answer.')


@dataclass(frozen=True)
class ScriptedTurn:
    user: str
    tool: str
    result: dict


TURNS = [
    ScriptedTurn("What's the weather in Paris tomorrow? Should I pack an umbrella?", "get_weather",
                 {"city": "Paris", "forecast": "rain showers", "high_c": 14, "low_c": 8, "precip_prob": 0.7}),
    ScriptedTurn("How many days until my dentist appointment?", "get_calendar",
                 {"today": "2026-03-02", "events": [{"date": "2026-03-12", "title": "Dentist", "time": "09:30"}]}),
    ScriptedTurn("Convert 250 euros to US dollars.", "convert_currency",
                 {"amount": 250, "source": "EUR", "target": "USD", "rate": 1.08, "result": 270.0}),
    ScriptedTurn("What is 17% of 2,340, rounded to the nearest whole number?", "calculator",
                 {"expression": "0.17 * 2340", "value": 397.8}),
    ScriptedTurn("Find the docs on how to reset my router password.", "search_docs",
                 {"query": "reset router password", "top_result": "Hold the reset button for 10 seconds, then log in "
                  "at 192.168.1.1 with admin/admin and set a new password under Security."}),
    ScriptedTurn("Is it warmer in Madrid than in Paris tomorrow?", "get_weather",
                 {"city": "Madrid", "forecast": "sunny", "high_c": 21, "low_c": 11, "precip_prob": 0.05}),
    ScriptedTurn("What do I have on my calendar on March 12?", "get_calendar",
                 {"date": "2026-03-12", "events": [{"time": "09:30", "title": "Dentist"},
                                                   {"time": "14:00", "title": "Team sync"}]}),
    ScriptedTurn("Split a 86.40 dollar bill between 3 people.", "calculator",
                 {"expression": "86.40 / 3", "value": 28.8}),
]

# step -> max new tokens; the four generations of one agent turn, in order
STEPS = {"plan": 48, "tool_call": 40, "read": 40, "answer": 64}
INSTRUCTIONS = {"tool_call": "Call the right tool now. Reply with only the JSON object.",
                "answer": "Now give me the final answer in one or two sentences."}


def step_message(step: str, turn: ScriptedTurn) -> dict:
    """The message an agent loop adds to the conversation before generating ``step``."""
    if step == "plan":
        return {"role": "user", "content": turn.user}
    if step == "read":
        return {"role": "tool", "content": json.dumps({"tool": turn.tool, "result": turn.result})}
    return {"role": "user", "content": INSTRUCTIONS[step]}


class ScriptedAgent:
    """One agent's conversation as a sequence of generations: :meth:`next_request` gives the messages to answer
    and the token budget, :meth:`reply` appends the target's answer. ``first_turn`` rotates the script, so agents
    served side by side ask different things; ``num_turns`` user turns (4 generations each), cycling the script."""

    def __init__(self, num_turns: int, first_turn: int = 0):
        if num_turns < 1:
            raise ValueError(f"ScriptedAgent: num_turns must be >= 1, got {num_turns}")
        self.turns = [TURNS[(first_turn + i) % len(TURNS)] for i in range(num_turns)]
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
        self.generation = 0  # generations answered so far
        self._pending = False

    @property
    def num_generations(self) -> int:
        return len(self.turns) * len(STEPS)

    @property
    def done(self) -> bool:
        return self.generation >= self.num_generations

    def next_request(self) -> tuple[list[dict], int]:
        """(the conversation to answer, max new tokens) for the next generation."""
        if self.done or self._pending:
            raise RuntimeError("ScriptedAgent.next_request: " + ("the script is over" if self.done else
                                                                 "the last request has no reply yet"))
        turn, step = divmod(self.generation, len(STEPS))
        name = list(STEPS)[step]
        self.messages.append(step_message(name, self.turns[turn]))
        self._pending = True
        return list(self.messages), STEPS[name]

    def reply(self, text: str) -> None:
        if not self._pending:
            raise RuntimeError("ScriptedAgent.reply: no request is waiting for a reply")
        self.messages.append({"role": "assistant", "content": text})
        self.generation += 1
        self._pending = False


def render_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation, chat-templated with the generation prompt, as token ids."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)


__all__ = ["INSTRUCTIONS", "STEPS", "SYSTEM_PROMPT", "TURNS", "ScriptedAgent", "ScriptedTurn", "render_ids",
           "step_message"]
