"""ChatSession: multi-turn history through the chat template; replies with a drafter equal plain replies."""

from __future__ import annotations

import torch
from conftest import TINY_VOCAB, make_tiny_llama
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_dspark import DSparkDraftModel
from hf_dspark.generation.chat import ChatSession

# role and turn markers are ordinary vocabulary words, so the template renders to known ids
TEMPLATE = ("{% for m in messages %}w3 {{ {'system': 'w4', 'user': 'w5', 'assistant': 'w6'}[m['role']] }} "
            "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3 w6 {% endif %}")


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_multi_turn_replies_with_drafter_equal_plain_and_history_is_rendered():
    target, tokenizer = make_tiny_llama(), make_tokenizer()
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    plain = ChatSession(target, tokenizer, system_prompt="w9 w10", max_new_tokens=10)
    spec = ChatSession(target, tokenizer, draft, system_prompt="w9 w10", max_new_tokens=10)
    for user in ("w20 w21 w22", "w30 w31"):
        expected, got = plain.reply(user), spec.reply(user)
        assert got.token_ids == expected.token_ids and got.text == expected.text
        assert got.stats is draft.stats and got.stats.rounds > 0 and expected.stats is None
        assert "tau" in got.summary() and "tok/s" in expected.summary()
    assert [m["role"] for m in spec.messages] == ["system", "user", "assistant", "user", "assistant"]
    reply1, reply2 = ([int(w[1:]) for w in spec.messages[i]["content"].split()] for i in (2, 4))
    assert reply1 and reply2
    assert spec.prompt_ids()[0].tolist() == [3, 4, 9, 10, 3, 5, 20, 21, 22, 3, 6, *reply1, 3, 5, 30, 31, 3, 6,
                                             *reply2, 3, 6]
