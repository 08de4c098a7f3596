"""Multi-turn chat on a target with an optional drafter, timed per reply: what ``hf-dspark generate`` and the
agent-loop benchmark run.

Why a class: a chat keeps its message history and renders it with the tokenizer's chat template on every turn, so
each reply is one ordinary ``target.generate(..., assistant_model=draft)`` call on the whole conversation (the
target's cache is not reused across turns, exactly as a stateless chat server would do).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..metrics import DSparkStats

logger = logging.getLogger(__name__)


@dataclass
class ChatReply:
    """One generated reply: its text and token ids, wall time of the generate call, and the drafter's stats."""

    text: str
    token_ids: list[int]
    seconds: float
    stats: DSparkStats | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        line = f"{self.num_tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_second:.1f} tok/s)"
        if self.stats is not None and self.stats.rounds:
            line += (f", tau {self.stats.tau:.2f} (incl. bonus) over {self.stats.rounds} rounds, "
                     f"acceptance {self.stats.acceptance_rate:.0%}")
            if self.stats.by_source:  # where the drafts came from: lookup, the drafter, or none (plain rounds)
                line += " [" + "; ".join(self.stats.source_summary(name) for name in sorted(self.stats.by_source)) + "]"
        return line


@dataclass
class ChatSession:
    """A conversation with ``target`` (drafting with ``drafter`` when given).

    ``generation_kwargs`` go to every ``generate`` call (e.g. ``do_sample``, ``temperature``); greedy by default.
    """

    target: object
    tokenizer: object
    drafter: object | None = None
    system_prompt: str | None = None
    max_new_tokens: int = 256
    generation_kwargs: dict = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.system_prompt and not self.messages:
            self.messages.append({"role": "system", "content": self.system_prompt})

    def add_message(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})

    def prompt_ids(self) -> torch.Tensor:
        """The conversation so far, rendered for the assistant's next turn: [1, n] token ids."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        # NOTE: tokenizers without a chat template (base models) just see the turns one per line
        text = "\n".join(message["content"] for message in self.messages)
        return self.tokenizer(text, return_tensors="pt")["input_ids"]

    def reply(self, user_text: str | None = None, streamer=None) -> ChatReply:
        """Add ``user_text`` (if any) as a user turn, generate the assistant's reply and append it to the history.

        All or nothing: a reply that does not complete (an error, or Ctrl-C stopping it) leaves the history as it
        was before the call, so the chat can go on from the last complete exchange.
        """
        num_messages = len(self.messages)
        try:
            if user_text is not None:
                self.add_message("user", user_text)
            return self._generate_reply(streamer)
        except BaseException:  # KeyboardInterrupt included: that is how a user stops a reply
            del self.messages[num_messages:]
            raise

    def _generate_reply(self, streamer) -> ChatReply:
        input_ids = self.prompt_ids().to(self.target.device)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        kwargs = {"do_sample": False, "pad_token_id": pad, **self.generation_kwargs}
        if self.drafter is not None:
            kwargs["assistant_model"] = self.drafter
        start = time.perf_counter()
        out = self.target.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                   max_new_tokens=self.max_new_tokens, streamer=streamer, **kwargs)
        seconds = time.perf_counter() - start
        new_ids = out[0, input_ids.shape[1]:].tolist()
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        self.add_message("assistant", text)
        stats = getattr(self.drafter, "stats", None) if self.drafter is not None else None
        return ChatReply(text=text, token_ids=new_ids, seconds=seconds, stats=stats)
