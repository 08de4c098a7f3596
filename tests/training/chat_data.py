"""Test data for training: a tiny offline ChatML tokenizer (fits the tiny targets' 96-token vocabulary) and chats.

A plain module (not a conftest.py): tests import it by name, as they import tests/conftest.py's helpers.
"""

from __future__ import annotations

import random

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nyou are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
WORDS = ("system user assistant you are a helpful zero one two three four five six seven eight nine ten "
         "eleven twelve red green blue cat dog bird fish tree rock sun moon star sky sea hill road car bus "
         "train boat plane book pen cup hat shoe door wall roof floor lamp desk chair bed what count from to "
         "please then and").split()
COUNTING = WORDS[7:20]  # zero .. twelve: answers continue this cycle, so the next word is learnable


def make_chat_tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + ["\n", " ", ".", ",", "?"] + WORDS)}
    assert len(vocab) <= 90, len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]|\s"), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                  unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def counting_answer(rng: random.Random, length: int) -> str:
    start = rng.randrange(len(COUNTING))
    return " ".join(COUNTING[(start + i) % len(COUNTING)] for i in range(length))


def make_chat_records(num: int, seed: int = 0, answer_length: tuple[int, int] = (16, 30)) -> list[dict]:
    """Conversations whose answers count through a cycle of words; every tenth has a second exchange."""
    rng = random.Random(seed)
    nouns = WORDS[20:60]
    records = []
    for i in range(num):
        question = f"please count from {rng.choice(COUNTING)} to {rng.choice(COUNTING)} {rng.choice(nouns)} ?"
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": counting_answer(rng, rng.randint(*answer_length))}]
        if i % 10 == 9:
            messages += [{"role": "user", "content": "then what ?"},
                         {"role": "assistant", "content": counting_answer(rng, rng.randint(*answer_length))}]
        records.append({"id": f"r{i:04d}", "category": "chat", "messages": messages, "finish_reason": "stop"})
    return records


@pytest.fixture(scope="module", autouse=False)
def single_thread():
    """Tiny models run ~40x faster on 1 thread than on 2 when another process keeps the cores busy."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
