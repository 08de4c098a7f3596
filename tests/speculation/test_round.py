"""The shared round reads the device twice per round, whatever the batch size and τ: once for what the policy
needs (drafts proposed + confidences), once for what the host commits (accepted counts + tokens)."""

from __future__ import annotations

import contextlib
import functools
import types
import weakref

import pytest
import torch
from conftest import make_tiny_llama

import hf_dspark.speculation.round as round_module
from hf_dspark import DSparkDraftModel
from hf_dspark.speculation.ragged_batch import RaggedBatch

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


@pytest.mark.parametrize("lengths", [[9], [9, 5]])
def test_padding_mask_only_where_the_batch_has_holes(lengths):
    """The round hands the target no padding mask when no row has a hole (batch 1: its rejected slots are cropped)
    and the batch's mask whenever one has; the host's has_holes agrees with the device mask every round, and the
    output is plain greedy's either way."""
    target = make_tiny_llama(seed=0)
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    g = torch.Generator().manual_seed(2)
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(width - n, dtype=torch.long), torch.randint(3, 96, (n,), generator=g)])
                       for n in lengths])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - n for n in lengths])[:, None]).long()
    seen = []
    real_run = round_module.SpeculativeRound.run
    real_forward = target.forward

    def run(self, batch, *args, **kwargs):
        seen.append((batch.has_holes, bool((batch.mask == 0).any())))
        return real_run(self, batch, *args, **kwargs)

    def forward(*args, **kwargs):
        if kwargs.get("logits_to_keep", 1) > 1:  # a verify forward (prefill keeps 1)
            seen.append(("mask", kwargs.get("attention_mask") is not None))
        return real_forward(*args, **kwargs)

    round_module.SpeculativeRound.run = run
    target.forward = functools.wraps(real_forward)(forward)
    try:
        got = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, assistant_model=draft,
                              dspark_confidence_threshold=0.0, dspark_lookup=False)
    finally:
        round_module.SpeculativeRound.run = real_run
        del target.forward
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    assert torch.equal(got, plain)
    rounds = [s for s in seen if s[0] != "mask"]
    masks = [s[1] for s in seen if s[0] == "mask"]
    assert rounds and all(host == device for host, device in rounds)
    if len(lengths) == 1:
        assert not any(masks) and not any(host for host, _ in rounds)
    else:
        assert any(host for host, _ in rounds) and any(masks)


def test_rounds_report_their_width_class_with_their_time(monkeypatch):
    """The policy corrects wide and 1-token steps apart, so each timed round must say which it was (and how many
    rows it ran): a round is reported as wide exactly when it verified drafts (width > 1), drafted or lookup. A
    drafting round that first projects the context of rounds the drafter skipped is reported too, without that
    projection's time: it is paid whether or not the drafter runs (a flush bounds the backlog), so it is no price
    of drafting — and unreported, a drafter stopped by a dear-looking step could never be re-priced (every probe
    after skipped rounds carries a backlog). The round runs on a fake clock on which the backlog's projection takes
    ``slow`` seconds and everything else next to nothing: no report may carry it."""
    from hf_dspark.scheduling import ScheduledPolicy

    class EveryThirdRoundDrafts(ScheduledPolicy):  # the drafter skips two rounds, then drafts (with a backlog)
        rounds = 0

        def wants_drafts(self, *args, **kwargs) -> bool:
            self.rounds += 1
            return self.rounds % 3 == 0

        def plan_sources(self, lookup_confidences, *args, **kwargs):
            use_lookup, _ = super().plan_sources(lookup_confidences, *args, **kwargs)
            return use_lookup, self.wants_drafts()

    target = make_tiny_llama(seed=0)
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]])  # repeats: lookup proposes
    widths, reports, seconds = [], [], []
    real_run, real_observe = round_module.SpeculativeRound.run, ScheduledPolicy.observe_step
    real_flush_backlog = RaggedBatch.flush_backlog
    slow, tick = 0.25, 1e-6
    clock = [0.0]

    def perf_counter() -> float:  # the round's clock: every reading a tick later
        clock[0] += tick
        return clock[0]

    def flush_backlog(self, draft):
        clock[0] += slow
        return real_flush_backlog(self, draft)

    def run(self, batch, *args, **kwargs):
        backlog = batch.num_deferred_steps
        result = real_run(self, batch, *args, **kwargs)
        widths.append((result.width, result.block is not None, backlog))
        return result

    def observe_step(self, drafted, predicted_seconds, step_seconds, *, sampled=False, wide=None, rows=None):
        assert rows == 1  # and its row count (corrections are kept per row count)
        reports.append((wide, drafted))
        seconds.append(step_seconds)
        return real_observe(self, drafted, predicted_seconds, step_seconds, sampled=sampled, wide=wide, rows=rows)

    monkeypatch.setattr(round_module, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(round_module.SpeculativeRound, "run", run)
    monkeypatch.setattr(ScheduledPolicy, "observe_step", observe_step)
    monkeypatch.setattr(RaggedBatch, "flush_backlog", flush_backlog)
    target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                    assistant_model=draft, dspark_policy=EveryThirdRoundDrafts())
    assert reports == [(width > 1, drafted) for width, drafted, backlog in widths]
    kinds = {(width > 1, drafted, drafted and backlog > 1) for width, drafted, backlog in widths}
    assert len(reports) > 3 and {(True, True, True), (False, False, False)} <= kinds, kinds
    with_backlog = [s for s, (_, drafted, backlog) in zip(seconds, widths) if drafted and backlog > 1]
    assert with_backlog and all(0 < s < slow for s in with_backlog), with_backlog
