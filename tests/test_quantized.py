"""bitsandbytes targets (8-bit and 4-bit, on CPU): drafting stays lossless w.r.t. the quantized target itself.

A tiny Llama is saved and reloaded with a BitsAndBytesConfig, as users load real targets. bitsandbytes keeps the
input embedding and the LM head unquantized (the drafter reads both by reference), so drafters bind unchanged;
a drafter built on the full-precision target also binds to its quantized copy (same embedding signature).

NOTE: 8-bit uses ``llm_int8_threshold=0.0``. With the default threshold (6.0) LLM.int8 picks its fp16 "outlier"
columns from all tokens of a forward call, so the quantized target's own logits depend on how many tokens one call
holds (on this tiny model: up to 0.23 between a 7-token chunk and 7 single-token steps). Verification runs γ+1
tokens per call where plain decoding runs one, so near-ties can then resolve differently, as they can between
plain prefill and decode, or in transformers' own assisted generation. With threshold 0 every token is quantized
on its own and chunked logits equal step-by-step ones to ~1e-6.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama

from hf_dspark import DSparkDraftModel

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is the optional 'quantization' extra")

PROMPTS = [torch.tensor([[1, 5, 9, 22, 7, 3]]), torch.tensor([[1, 40, 41, 90, 3]]), torch.tensor([[1, 60, 12]])]
MAX_NEW_TOKENS = 20


def quantization_config(bits: int):
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)  # see the module docstring
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_llama().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[8, 4], ids=["8bit", "4bit"])
def quantized(request, saved_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved_target, quantization_config=quantization_config(request.param),
                                                 device_map="cpu").eval()
    expected_layer = bnb.nn.Linear8bitLt if request.param == 8 else bnb.nn.Linear4bit
    assert isinstance(model.model.layers[0].self_attn.q_proj, expected_layer)  # really quantized
    references = [model.generate(p, max_new_tokens=MAX_NEW_TOKENS, do_sample=False) for p in PROMPTS]
    return model, references


def test_untrained_drafter_greedy_identical_to_quantized_target(quantized):
    target, references = quantized
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    for prompt, expected in zip(PROMPTS, references):
        got = target.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, assistant_model=draft)
        assert torch.equal(got, expected)


def test_batch_of_prompts_identical_to_quantized_target(quantized):
    target, references = quantized
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    width = max(p.shape[1] for p in PROMPTS)
    ids = torch.cat([torch.cat([torch.zeros(1, width - p.shape[1], dtype=torch.long), p], 1) for p in PROMPTS])
    mask = (torch.arange(width)[None] >= torch.tensor([width - p.shape[1] for p in PROMPTS])[:, None]).long()
    got = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                          assistant_model=draft)
    for row, (prompt, expected) in enumerate(zip(PROMPTS, references)):
        new = got[row, width:].tolist()
        want = expected[0, prompt.shape[1]:].tolist()
        assert new[:len(want)] == want and all(t == 0 for t in new[len(want):])  # pad after EOS


class ReferenceDrafter:
    """Drafts the quantized target's own greedy continuation (first ``k`` slots right, k cycling through
    ``pattern``): drives accept-all and partial rounds through verification of the quantized target."""

    def __init__(self, draft, reference: torch.Tensor, pattern: list[int]):
        self.draft_block, self.reference, self.pattern, self.calls = draft.draft_block, reference[0], pattern, 0

    def __call__(self, cache, anchor_ids, anchor_positions, **kwargs):
        block = self.draft_block(cache, anchor_ids, anchor_positions, **kwargs)
        gamma, start = block.tokens.shape[1], int(anchor_positions[0]) + 1
        tokens = torch.full((gamma,), 3, dtype=torch.long)
        cont = self.reference[start:start + gamma]
        tokens[:len(cont)] = cont
        k = self.pattern[self.calls % len(self.pattern)]
        self.calls += 1
        tokens[k:] = (tokens[k:] + 1) % 96  # wrong from slot k on
        block.tokens = tokens[None]
        return block


def test_accepted_blocks_on_quantized_target_are_lossless(quantized, monkeypatch):
    target, references = quantized
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    for prompt, expected in zip(PROMPTS, references):
        monkeypatch.setattr(draft, "draft_block", ReferenceDrafter(draft, expected, pattern=[5, 2, 0, 4, 5]))
        # the fixed policy verifies every block (the scheduler's choice depends on this machine's step cost)
        got = target.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, assistant_model=draft,
                              dspark_policy="fixed", dspark_lookup=False)
        assert torch.equal(got, expected)
        if expected.shape[1] - prompt.shape[1] >= 12:
            assert draft.stats.tau > 2.0  # the accepted blocks were really used


def test_drafter_saved_for_full_precision_target_binds_to_quantized_copy(quantized, saved_target, tmp_path):
    from transformers import AutoModelForCausalLM

    target, references = quantized
    full = AutoModelForCausalLM.from_pretrained(saved_target).eval()
    torch.manual_seed(1)
    DSparkDraftModel.from_target(full, num_layers=1, block_size=5, markov_rank=16).save_pretrained(tmp_path)
    draft = DSparkDraftModel.from_pretrained(tmp_path, target=target)  # embedding signature must still match
    got = target.generate(PROMPTS[0], max_new_tokens=MAX_NEW_TOKENS, do_sample=False, assistant_model=draft)
    assert torch.equal(got, references[0])


def test_default_int8_outlier_threshold_is_warned_about(saved_target, caplog):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    target = AutoModelForCausalLM.from_pretrained(saved_target, device_map="cpu",
                                                  quantization_config=BitsAndBytesConfig(load_in_8bit=True)).eval()
    with caplog.at_level("WARNING", logger="hf_dspark.modeling.target_compatibility"):
        DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16)
    assert "llm_int8_threshold=6.0" in caplog.text


def test_zero_int8_threshold_is_not_warned_about(quantized, caplog):
    target, _ = quantized
    with caplog.at_level("WARNING", logger="hf_dspark.modeling.target_compatibility"):
        DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16)
    assert "llm_int8_threshold" not in caplog.text
