"""Training prompts: read the common formats, synthesise a mix when none is at hand, refuse evaluation overlap.

A drafter learns the *target's own* answers, so prompts only have to cover the kinds of requests the target
will serve (math, code, chat). When a user has no prompt set, we build one from two sources:

* templated prompts — cheap, diverse by combination, shaped like the benchmark families (word problems with a
  "reason step by step" suffix, function-writing tasks with a docstring stub, open chat requests);
* Magpie-style prompts — the instruct target writes a user request itself when fed only the chat template's
  user-turn prefix (see :func:`magpie_prefix`); done in ``regenerate.py`` because it needs the model.

Evaluation prompts must never be trained on: :class:`EvalOverlapGuard` rejects any prompt that equals an
evaluation prompt after normalisation or shares a long word n-gram with one.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n"


@dataclass(frozen=True)
class Prompt:
    """One conversation's user turns (only the first is used for regeneration of single-turn data)."""

    turns: tuple[str, ...]
    category: str = "unknown"

    @property
    def first_turn(self) -> str:
        return self.turns[0]


def _turns_from_record(record: dict) -> list[str]:
    if "turns" in record:  # DeepSpec / shared/eval_datasets
        return [str(t) for t in record["turns"]]
    messages = record.get("messages") or record.get("conversations")
    if messages:  # OpenAI `messages` ({role, content}) or ShareGPT `conversations` ({from, value})
        turns = []
        for m in messages:
            role = m.get("role", m.get("from"))
            text = m.get("content", m.get("value"))
            if role in ("user", "human") and text:
                turns.append(str(text))
        return turns
    for key in ("prompt", "instruction", "question"):
        if key in record:
            return [str(record[key])]
    raise ValueError(f"Unrecognised prompt record (keys {sorted(record)}); expected 'turns', 'messages', "
                     "'conversations', 'prompt', 'instruction' or 'question'.")


class PromptFileError(ValueError):
    """A prompt file that cannot be read (not UTF-8 text, a line that is not JSON, a record of no known format) or
    that holds no prompts where some are needed: the message names the file, the line and what is wrong."""


def _prompt_records(path: Path) -> list[tuple[int, object]]:
    """``(line, record)`` of a jsonl file, or ``(index, record)`` of a .json list; a damaged line raised a bare
    JSONDecodeError that named neither the file nor the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise PromptFileError(f"{path} is not UTF-8 text (prompt files are jsonl or json).") from None
    if path.suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise PromptFileError(f"{path}: not valid JSON ({err}).") from None
        if not isinstance(records, list):
            raise PromptFileError(f"{path}: a .json prompt file holds a list of records, not a "
                                  f"{type(records).__name__}.")
        return list(enumerate(records, 1))
    numbered = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                numbered.append((line_no, json.loads(line)))
            except json.JSONDecodeError as err:
                raise PromptFileError(f"{path}:{line_no}: not valid JSON ({err.msg} at column {err.colno}).") from None
    return numbered


def read_prompts(path: str | Path, category: str = "unknown") -> list[Prompt]:
    """Read a jsonl (one record a line) or json (a list of records) prompt file in any supported format; a file
    that cannot be read raises :class:`PromptFileError` naming the line."""
    path = Path(path)
    prompts = []
    for line_no, record in _prompt_records(path):
        try:
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not a record")
            turns = _turns_from_record(record)
        except ValueError as err:
            raise PromptFileError(f"{path}:{line_no}: {err}") from None
        except (AttributeError, TypeError) as err:  # e.g. messages that are a string, not a list of dicts
            raise PromptFileError(f"{path}:{line_no}: a malformed record ({err}).") from None
        if turns:
            prompts.append(Prompt(tuple(turns), record.get("category", category)))
    return prompts


# ---------------------------------------------------------------------------------------------------------
# Evaluation-overlap guard
# ---------------------------------------------------------------------------------------------------------

def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", " ", text.lower())).strip()


class EvalOverlapError(ValueError):
    """Training or calibration prompts that overlap the evaluation sets: the message quotes one."""


class EvalOverlapGuard:
    """Detects training prompts that are, or copy a long span of, an evaluation prompt.

    A prompt overlaps if its normalised text equals an evaluation prompt's, or if they share a run of
    ``ngram`` consecutive words (13 is the usual contamination-check length). The boilerplate we add
    ourselves (the math suffix, the code preamble) is stripped first so that it never counts as overlap.
    """

    def __init__(self, eval_texts: Iterable[str], ngram: int = 13):
        self.ngram = ngram
        self._exact: set[str] = set()
        self._ngrams: set[tuple[str, ...]] = set()
        for text in eval_texts:
            norm = _normalise(self._strip_boilerplate(text))
            self._exact.add(norm)
            self._ngrams.update(self._grams(norm))

    @staticmethod
    def _strip_boilerplate(text: str) -> str:
        return text.replace(MATH_SUFFIX, "").replace(CODE_PREFIX, "")

    def _grams(self, norm: str) -> Iterator[tuple[str, ...]]:
        words = norm.split()
        for i in range(len(words) - self.ngram + 1):
            yield tuple(words[i:i + self.ngram])

    @classmethod
    def from_dir(cls, eval_dir: str | Path, ngram: int = 13) -> "EvalOverlapGuard":
        texts = []
        for file in sorted(Path(eval_dir).glob("*.jsonl")):
            texts.extend(t for p in read_prompts(file) for t in p.turns)
        return cls(texts, ngram=ngram)

    def overlaps(self, text: str) -> bool:
        norm = _normalise(self._strip_boilerplate(text))
        return norm in self._exact or any(g in self._ngrams for g in self._grams(norm))

    def raise_if_overlapping(self, prompts: Iterable[Prompt]) -> None:
        bad = [p.first_turn[:80] for p in prompts if any(self.overlaps(t) for t in p.turns)]
        if bad:
            raise EvalOverlapError(f"{len(bad)} training prompt(s) overlap the evaluation sets (e.g. {bad[0]!r}); "
                                   "remove them: a drafter must never be trained on its evaluation prompts.")


# ---------------------------------------------------------------------------------------------------------
# Templated synthesis
# ---------------------------------------------------------------------------------------------------------

_NAMES = ["Maya", "Omar", "Lena", "Kofi", "Sofia", "Ravi", "Hana", "Diego", "Ines", "Tom", "Aiko", "Yusuf",
          "Clara", "Mateo", "Priya", "Jonas", "Zara", "Felix", "Amara", "Leo", "Nora", "Ivan", "Mei", "Sam"]
_ITEMS = [("apples", "apple"), ("stickers", "sticker"), ("books", "book"), ("cupcakes", "cupcake"),
          ("marbles", "marble"), ("pencils", "pencil"), ("tickets", "ticket"), ("plants", "plant"),
          ("shirts", "shirt"), ("cookies", "cookie"), ("toy cars", "toy car"), ("postcards", "postcard")]
_MATH_TEMPLATES = [
    "{n} has {a} {items}. {p} gives {n} {b} more, and then {n} sells {c} of them for ${d} each. "
    "How much money does {n} make, and how many {items} are left?",
    "A shop sells {items} for ${d} each. {n} buys {a} {items} and pays with a ${e} bill. How much change does {n} get?",
    "{n} reads {a} pages on Monday and {b} pages on each of the next {c} days. The book has {e} pages. "
    "How many pages are left to read?",
    "{n} earns ${d} per hour and works {a} hours a week. After {c} weeks, {n} spends ${b} on a bike. "
    "How much money is left?",
    "A train travels at {a} miles per hour for {c} hours, then at {b} miles per hour for {d} hours. "
    "What is the total distance travelled?",
    "{n} and {p} share {e} {items}. {n} gets {a} more than {p}. How many {items} does each get?",
    "A rectangle has a length of {a} cm and a width of {c} cm. What is its area and its perimeter?",
    "{n} saves ${c} every week. How many weeks does it take to save ${e}?",
    "There are {a} students in a class. {b} percent of them like math. How many students like math?",
    "A recipe needs {c} cups of flour for {d} cookies. How many cups are needed for {e} cookies?",
    "{n} buys {c} packs of {items} with {a} in each pack, then gives {b} {items} to {p}. How many are left?",
    "The price of a {item} is ${e}. It goes on sale for {b} percent off. What is the sale price?",
    "What is the sum of all integers from 1 to {e}?",
    "Solve for x: {c}x + {a} = {e}.",
    "What is the remainder when {e} is divided by {c}?",
    "Find the least common multiple of {c} and {d}.",
    "A car uses {c} liters of fuel per 100 km. How much fuel does it need for {e} km?",
    "{n} is {a} years old. {p} is {c} times as old as {n} was {d} years ago. How old is {p}?",
]
_CODE_TASKS = [
    "reverse the words in a sentence", "check whether a number is prime", "return the n-th Fibonacci number",
    "count the vowels in a string", "find the second largest number in a list", "remove duplicates from a list "
    "while keeping order", "check whether two strings are anagrams", "flatten a nested list",
    "compute the factorial of n", "merge two sorted lists into one sorted list", "find the most frequent element "
    "in a list", "convert a decimal number to binary", "check whether a string is a palindrome",
    "compute the greatest common divisor of two numbers", "rotate a list by k positions", "find all pairs in a "
    "list that sum to a target", "capitalize the first letter of every word", "compute the running sum of a list",
    "return the indices of the maximum values", "split a list into chunks of size n", "count the words in a text",
    "check whether a list is sorted", "compute the median of a list", "transpose a matrix", "find the longest "
    "common prefix of a list of strings", "validate a balanced parentheses string", "compute the sum of digits of "
    "a number", "find the missing number in a list from 1 to n", "convert a string to title case without str.title",
    "return the unique characters of a string", "compute the dot product of two vectors", "find the intersection "
    "of two lists", "count occurrences of each character", "check whether a year is a leap year", "find the "
    "longest word in a sentence", "compute the power set of a list", "implement binary search", "implement "
    "bubble sort", "compute the area of a circle given its radius", "convert Celsius to Fahrenheit",
    "return every other element of a list", "compute the cumulative product of a list", "check whether a "
    "number is a perfect square", "find the k smallest elements of a list", "compress a string with run-length "
    "encoding", "decode a run-length encoded string", "sum the even numbers in a list", "find the first "
    "non-repeating character in a string", "group words by their first letter", "compute the mean and standard "
    "deviation of a list",
]
_CODE_TEMPLATES = ["Write a python function to {task}.", "Write a function to {task}.",
                   "Write a Python function that {task_s}.", "Implement a Python function to {task} and explain it.",
                   "Write a short Python program to {task}, with a docstring and an example."]
_CHAT_TOPICS = ["time management", "learning a new language", "healthy sleep habits", "saving money", "a job "
                "interview", "climate change", "the history of the internet", "photosynthesis", "black holes",
                "public speaking", "starting a vegetable garden", "remote work", "the water cycle", "meditation",
                "electric cars", "a trip to Japan", "a birthday party", "writing a resume", "renewable energy",
                "the Roman Empire", "machine learning", "making friends in a new city", "cooking pasta",
                "recycling", "the benefits of reading", "volcanoes", "staying motivated", "team work",
                "a rainy day", "the ocean", "social media", "exercise for beginners", "a small business"]
_CHAT_TEMPLATES = ["Give me some tips for {t}.", "Explain {t} in simple terms.", "Write a short poem about {t}.",
                   "Write a short blog post about {t}.", "What are the pros and cons of {t}?",
                   "Write a friendly email to a colleague about {t}.", "Summarize the key ideas of {t} in a "
                   "few bullet points.", "Tell me a short story about {t}.", "Why is {t} important?",
                   "Compose a persuasive paragraph about {t}.", "What should a beginner know about {t}?",
                   "Describe {t} to a ten-year-old."]


def _math_prompt(rng: random.Random) -> str:
    items, item = rng.choice(_ITEMS)
    n, p = rng.sample(_NAMES, 2)
    values = dict(n=n, p=p, items=items, item=item, a=rng.randint(2, 60), b=rng.randint(2, 40),
                  c=rng.randint(2, 12), d=rng.randint(2, 25), e=rng.randint(40, 500))
    return rng.choice(_MATH_TEMPLATES).format(**values) + MATH_SUFFIX


def _code_prompt(rng: random.Random) -> str:
    task = rng.choice(_CODE_TASKS)
    if rng.random() < 0.35:  # HumanEval-shaped: a signature + docstring stub to complete
        name = re.sub(r"[^a-z0-9]+", "_", task.lower()).strip("_")[:40]
        stub = f'```python\ndef {name}(*args):\n    """ {task[0].upper() + task[1:]}.\n    """\n\n```'
        return CODE_PREFIX + stub
    task_s = re.sub(r"^(\w+)", lambda m: m.group(1) + ("es" if m.group(1).endswith(("sh", "ch", "x")) else "s"),
                    task)
    return rng.choice(_CODE_TEMPLATES).format(task=task, task_s=task_s)


def _chat_prompt(rng: random.Random) -> str:
    return rng.choice(_CHAT_TEMPLATES).format(t=rng.choice(_CHAT_TOPICS))


_SYNTHESISERS = {"math": _math_prompt, "code": _code_prompt, "chat": _chat_prompt}


def synthesise_template_prompts(num: int, seed: int = 0, mix: dict[str, float] | None = None,
                                guard: EvalOverlapGuard | None = None) -> list[Prompt]:
    """``num`` distinct templated prompts in the given category mix (default math 0.4, code 0.35, chat 0.25)."""
    mix = mix or {"math": 0.4, "code": 0.35, "chat": 0.25}
    rng = random.Random(seed)
    categories, weights = zip(*mix.items())
    seen: set[str] = set()
    prompts: list[Prompt] = []
    attempts = 0
    while len(prompts) < num and attempts < num * 50:
        attempts += 1
        category = rng.choices(categories, weights)[0]
        text = _SYNTHESISERS[category](rng)
        key = _normalise(text)
        if key in seen or (guard is not None and guard.overlaps(text)):
            continue
        seen.add(key)
        prompts.append(Prompt((text,), category))
    return prompts


def magpie_prefix(tokenizer, system_prompt: str | None = None) -> str:
    """The chat-template text up to where a user's words begin (Magpie): the instruct model then writes a request.

    Found by rendering a conversation with a sentinel user message and cutting at the sentinel, so it works for
    any chat template without knowing its markup.
    """
    sentinel = "\u2063SENTINEL\u2063"
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": sentinel}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    return rendered[: rendered.index(sentinel)]


def dedupe(prompts: Iterable[Prompt]) -> list[Prompt]:
    seen: set[str] = set()
    out = []
    for p in prompts:
        key = _normalise(p.first_turn)
        if key and key not in seen:
            seen.add(key)
            out.append(p)
    return out
