"""The CPU kernels hf-dspark's loop runs with: skinny linears (cpu_kernels.skinny_linear / skinny_linears), the same
products as F.linear within fp32 rounding, F.linear itself wherever the kernel does not apply, patched only inside
the block; GQA-folded attention (folded_gqa_sdpa), transformers' SDPA attention within fp32 rounding without
repeating keys and values; both used by generate and the engine unless turned off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import flat_cost, make_tiny_llama
from torch import nn

from hf_dspark import DSparkDraftModel
from hf_dspark.cpu_kernels import (
    FOLDED_GQA_ATTENTION,
    FOLDED_GQA_SUFFIX,
    SKINNY_KERNEL,
    SKINNY_MAX_ROWS,
    STOCK_KERNEL,
    folded_gqa_attention,
    folded_gqa_sdpa,
    linear_kernel,
    loop_kernels,
    skinny_applies,
    skinny_linear,
    skinny_linears,
)
from hf_dspark.scheduling.profile_cache import profile_cache_key

PROMPT = torch.tensor([[1, 17, 33, 5, 60, 41, 17, 33, 5]])
LOOP_KERNEL = SKINNY_KERNEL + FOLDED_GQA_SUFFIX  # what hf-dspark's loop runs the tiny (SDPA, GQA) llama with


@pytest.mark.parametrize("rows", range(1, SKINNY_MAX_ROWS + 3))
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_f_linear_within_rounding(rows, bias):
    torch.manual_seed(rows)
    weight, x = torch.randn(300, 72), torch.randn(rows, 72)
    b = torch.randn(300) if bias else None
    with torch.no_grad():
        out = skinny_linear(x, weight, b)
    assert out.shape == (rows, 300) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    if rows > SKINNY_MAX_ROWS:  # beyond the kernel's rows: F.linear itself
        assert torch.equal(out, F.linear(x, weight, b))


def test_skinny_linear_keeps_leading_dims_and_reads_strided_input():
    torch.manual_seed(0)
    weight = torch.randn(40, 16)
    x = torch.randn(2, 16, 3).transpose(1, 2)  # [2, 3, 16], not contiguous: 6 rows
    with torch.no_grad():
        out = skinny_linear(x, weight)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_skinny_linear_is_f_linear_where_it_does_not_apply():
    torch.manual_seed(0)
    weight = torch.randn(40, 16, requires_grad=True)
    x = torch.randn(3, 16)
    out = skinny_linear(x, weight)  # gradients wanted: the autograd path, bit for bit
    assert out.requires_grad and torch.equal(out, F.linear(x, weight))
    out.sum().backward()
    assert weight.grad is not None
    with torch.no_grad():
        x64, w64 = x.double(), weight.detach().double()
        assert torch.equal(skinny_linear(x64, w64), F.linear(x64, w64))  # not fp32


class _Hooked(nn.Module):
    """A module whose forward is already replaced on the instance (as accelerate's hooks do)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.inner.forward = lambda x: x * 0  # stand-in for a hook wrapper


def test_skinny_linears_patches_inside_the_block_only():
    model = make_tiny_llama()
    hooked = _Hooked()
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert linears and skinny_applies(model) and linear_kernel(model) == STOCK_KERNEL
    with skinny_linears(model, hooked, model):  # a model given twice is patched once
        assert linear_kernel(model) == SKINNY_KERNEL
        assert all("forward" in m.__dict__ for m in linears)
        with skinny_linears(model):  # re-entry leaves the outer patch in place
            assert linear_kernel(model) == SKINNY_KERNEL
        assert linear_kernel(model) == SKINNY_KERNEL
        assert hooked.inner(torch.ones(1, 8)).abs().sum() == 0  # the existing instance forward is untouched
    assert linear_kernel(model) == STOCK_KERNEL
    assert not any("forward" in m.__dict__ for m in linears)
    assert "forward" in hooked.inner.__dict__


def test_skinny_linears_gives_plain_generate_the_same_tokens():
    model = make_tiny_llama()
    expected = model.generate(PROMPT, do_sample=False, max_new_tokens=12)
    with skinny_linears(model):
        out = model.generate(PROMPT, do_sample=False, max_new_tokens=12)
    assert torch.equal(out, expected)


def test_step_cost_cache_key_names_the_kernel():
    model = make_tiny_llama()
    key = dict(context_len=16, row_len=4, dtype=torch.float32, device="cpu", repeats=1)
    stock = profile_cache_key(model, [1, 2], **key)
    with skinny_linears(model):
        skinny = profile_cache_key(model, [1, 2], **key)
    assert stock != skinny and profile_cache_key(model, [1, 2], **key) == stock


def _kernels_seen(model) -> tuple[list[str], object]:
    seen: list[str] = []
    handle = model.register_forward_pre_hook(lambda module, args: seen.append(linear_kernel(module)))
    return seen, handle


@pytest.mark.parametrize("cpu_linears", [True, False])
def test_generate_runs_its_loop_with_the_kernel_unless_turned_off(cpu_linears):
    target = make_tiny_llama()
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=16)
    seen, handle = _kernels_seen(target)
    out = target.generate(PROMPT, do_sample=False, max_new_tokens=16, assistant_model=draft,
                          dspark_step_cost=flat_cost(), dspark_cpu_linears=cpu_linears)
    handle.remove()
    assert torch.equal(out, expected)
    assert set(seen) == {LOOP_KERNEL if cpu_linears else STOCK_KERNEL}
    assert linear_kernel(target) == STOCK_KERNEL  # restored after the call


def test_stock_linears_keep_plain_rounds_bit_identical_to_plain_decoding():
    """With the kernel off, hf-dspark's plain rounds compute exactly what transformers' decoding step does."""
    target = make_tiny_llama()
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    kwargs = dict(do_sample=False, max_new_tokens=8, output_scores=True, return_dict_in_generate=True)
    plain = target.generate(PROMPT, **kwargs)
    ours = target.generate(PROMPT, assistant_model=draft, dspark_policy="none", dspark_lookup=False,
                           dspark_cpu_linears=False, **kwargs)
    assert torch.equal(ours.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, plain.scores, strict=True))


@pytest.mark.parametrize("cpu_linears", [True, False])
def test_engine_steps_run_with_the_kernel_unless_turned_off(cpu_linears):
    from hf_dspark.serving import DSparkEngine

    target = make_tiny_llama()
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=10)[0, PROMPT.shape[1]:].tolist()
    engine = DSparkEngine(target, draft, "scheduled", sps=flat_cost(), cpu_linears=cpu_linears)
    seen, handle = _kernels_seen(target)
    out = engine.generate([PROMPT[0].tolist()], max_new_tokens=10)[0]
    handle.remove()
    assert out.token_ids == expected
    assert set(seen) == {LOOP_KERNEL if cpu_linears else STOCK_KERNEL}
    assert linear_kernel(target) == STOCK_KERNEL


class _Grouped(nn.Module):
    """What transformers' attention functions read off an attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("length", [1, 2, 5])
def test_folded_gqa_sdpa_is_transformers_sdpa_within_rounding(groups, length):
    """Random queries over 2 key/value heads and a ragged mask (holes in the cache, causal among the new tokens):
    the folded attention equals transformers' SDPA attention within fp32 rounding, and one query token (or no
    grouping) goes to transformers' function itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(length * 10 + groups)
    batch, kv_heads, dim, slots = 3, 2, 16, 20
    query = torch.randn(batch, kv_heads * groups, length, dim)
    key, value = torch.randn(batch, kv_heads, slots, dim), torch.randn(batch, kv_heads, slots, dim)
    mask = (torch.rand(batch, 1, 1, slots) > 0.3).expand(batch, 1, length, slots).clone()  # holes
    mask[..., -length:] = torch.ones(length, length, dtype=torch.bool).tril()  # causal among the new tokens
    mask[..., 0] = True
    module = _Grouped(groups)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim ** -0.5)
    out, weights = folded_gqa_sdpa(module, query, key, value, mask, scaling=dim ** -0.5)
    assert weights is None and out.shape == expected.shape == (batch, length, kv_heads * groups, dim)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    if length == 1 or groups == 1:
        assert torch.equal(out, expected)


def test_folded_attention_switches_sdpa_models_only_inside_the_block():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = make_tiny_llama()
    assert model.config._attn_implementation == "sdpa"
    ids = PROMPT[:, :6]
    with torch.no_grad():
        before = model(ids, attention_mask=torch.ones_like(ids)).logits
        with folded_gqa_attention(model):
            assert model.config._attn_implementation == FOLDED_GQA_ATTENTION
            assert linear_kernel(model) == STOCK_KERNEL + FOLDED_GQA_SUFFIX
            with folded_gqa_attention(model):  # re-entry is a no-op
                pass
            assert model.config._attn_implementation == FOLDED_GQA_ATTENTION
            inside = model(ids, attention_mask=torch.ones_like(ids)).logits
        with loop_kernels(model):
            assert linear_kernel(model) == LOOP_KERNEL
    assert model.config._attn_implementation == "sdpa" and linear_kernel(model) == STOCK_KERNEL
    torch.testing.assert_close(inside, before, rtol=1e-5, atol=1e-5)
    eager = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "attn_implementation": "eager"})).eval()
    with folded_gqa_attention(eager):
        assert eager.config._attn_implementation == "eager"  # another implementation is left alone


def test_bf16_units_are_read_from_the_cpus_flags():
    from hf_dspark.cpu_kernels import cpu_has_bf16_units

    zen4 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
    skylake = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_vnni\n"
    sapphire = "flags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"
    graviton3 = "Features\t: fp asimd sve bf16 i8mm\n"
    assert cpu_has_bf16_units(zen4) and cpu_has_bf16_units(sapphire) and cpu_has_bf16_units(graviton3)
    assert not cpu_has_bf16_units(skylake) and not cpu_has_bf16_units("")
    assert isinstance(cpu_has_bf16_units(), bool)  # this machine's /proc/cpuinfo, or False where there is none


class _Headed(nn.Module):
    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.head = nn.Linear(cols, rows, bias=False)

    def get_output_embeddings(self):
        return self.head


def test_the_loop_runs_its_kernels_by_default_only_where_they_measured_faster(monkeypatch):
    from hf_dspark import cpu_kernels

    tiny = make_tiny_llama()  # too small to time: the loop's kernels, as before
    assert cpu_kernels.skinny_pays(tiny) and isinstance(cpu_kernels.loop_linears(None, tiny), cpu_kernels.loop_kernels)
    big = _Headed(2048, 2048)  # 4.2 M elements: measured once per process, head shape and threads
    key = ((2048, 2048), torch.get_num_threads())
    for measured in (False, True):
        monkeypatch.setitem(cpu_kernels._SKINNY_PAYS, key, measured)
        chosen = cpu_kernels.loop_linears(None, big)
        assert isinstance(chosen, cpu_kernels.loop_kernels) is measured
        assert isinstance(cpu_kernels.loop_linears(True, big), cpu_kernels.loop_kernels)  # True always runs them
        assert not isinstance(cpu_kernels.loop_linears(False, big), cpu_kernels.loop_kernels)


def test_skinny_pays_measures_once_and_returns_a_decision(monkeypatch):
    from hf_dspark import cpu_kernels

    big = _Headed(2048, 2048)
    monkeypatch.setattr(cpu_kernels, "_SKINNY_PAYS", {})
    calls = []
    real = cpu_kernels.skinny_linear
    monkeypatch.setattr(cpu_kernels, "skinny_linear", lambda *a: calls.append(1) or real(*a))
    first = cpu_kernels.skinny_pays(big, repeats=1)
    measured = len(calls)
    assert isinstance(first, bool) and measured > 0
    assert cpu_kernels.skinny_pays(big, repeats=1) is first and len(calls) == measured  # cached


def test_measuring_the_kernels_leaves_the_global_rng_alone(monkeypatch):
    """A process's first speculative call measures the kernels: it must not advance torch's global RNG, or a seeded
    sampling call (``torch.manual_seed(0); generate(do_sample=True, ...)``) would draw other tokens the first time."""
    from hf_dspark import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_SKINNY_PAYS", {})
    big = _Headed(2048, 2048)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    cpu_kernels.skinny_pays(big, repeats=1)
    assert torch.equal(torch.rand(4), expected)


def test_a_seeded_sampling_call_draws_the_same_tokens_on_a_process_first_call(monkeypatch):
    from hf_dspark import cpu_kernels

    target = make_tiny_llama()
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8).eval()
    monkeypatch.setattr(cpu_kernels, "MEASURED_HEAD_ELEMENTS", 0)  # the tiny head is measured, as a real one is
    monkeypatch.setattr(cpu_kernels, "_SKINNY_PAYS", {})
    prompt = torch.tensor([[1, 5, 9, 22, 7, 3]])
    kwargs = {"max_new_tokens": 8, "do_sample": True, "assistant_model": draft, "dspark_isolate": True,
              "dspark_policy": "fixed", "dspark_lookup": False}
    draws = []
    for _ in range(2):  # the first call measures the kernels, the second finds the decision made
        torch.manual_seed(0)
        draws.append(target.generate(prompt, **kwargs).tolist())
    assert draws[0] == draws[1]
