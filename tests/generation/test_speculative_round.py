"""The shared round reads the device twice per round, whatever the batch size and τ: once for what the policy
needs (drafts proposed + confidences), once for what the host commits (accepted counts + tokens)."""

from __future__ import annotations

import contextlib
import functools
import weakref

import pytest
import torch
from conftest import make_tiny_llama

import hf_dspark.generation.speculative_round as round_module
from hf_dspark import DSparkDraftModel

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "numpy")


@contextlib.contextmanager
def counting_reads(counts: list[int]):
    """Counts reads of tensors computed by the model (host tensors built from Python / numpy data and results of
    .cpu() / .numpy() are host memory already: reading them is free on an accelerator too)."""
    host: dict[int, weakref.ref] = {}
    patched = []

    def is_host(t) -> bool:
        ref = host.get(id(t))
        return ref is not None and ref() is t

    def mark(t):
        if isinstance(t, torch.Tensor):
            host[id(t)] = weakref.ref(t)
        return t

    for name in READS + ("cpu",):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            if counts[1] == 0 and not is_host(self):  # counts[1] > 0: inside the target's own forward
                counts[0] += 1  # .cpu() marks its result as host memory: .cpu().numpy() is one read
            result = _original(self, *a, **k)
            return mark(result) if _name == "cpu" else result

        patched.append((torch.Tensor, name, vars(torch.Tensor).get(name)))
        setattr(torch.Tensor, name, counted)
    for name in ("tensor", "as_tensor", "from_numpy"):
        original = getattr(torch, name)
        patched.append((torch, name, vars(torch).get(name)))
        setattr(torch, name, lambda *a, _original=original, **k: mark(_original(*a, **k)))
    try:
        yield
    finally:  # put back exactly what was there: an inherited method is deleted again, not copied onto the class
        for owner, name, own in patched:
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


@pytest.mark.parametrize("batch", [1, 8])
def test_two_device_reads_per_round(batch):
    target = make_tiny_llama(seed=0)
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    ids = torch.randint(3, 96, (batch, 9), generator=torch.Generator().manual_seed(2))
    rounds, reads = [0], [0, 0]
    real_run = round_module.SpeculativeRound.run
    real_forward = target.forward

    def forward(*args, **kwargs):  # reads inside transformers' forward (mask checks) are not the loop's
        reads[1] += 1
        try:
            return real_forward(*args, **kwargs)
        finally:
            reads[1] -= 1

    target.forward = functools.wraps(real_forward)(forward)

    def run(self, *args, **kwargs):
        rounds[0] += 1
        with counting_reads(reads):
            return real_run(self, *args, **kwargs)

    round_module.SpeculativeRound.run = run
    try:  # threshold 0: every round drafts (early exits are a CPU-only optimisation with reads of their own)
        target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                        assistant_model=draft, dspark_confidence_threshold=0.0, dspark_lookup=False)
    finally:
        round_module.SpeculativeRound.run = real_run
        del target.forward
    assert rounds[0] > 3 and reads[0] == 2 * rounds[0], (reads, rounds)
