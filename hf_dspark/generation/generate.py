"""``target.generate(..., assistant_model=draft)`` for any batch size: transformers glue around the shared round.

``generate`` reaches :func:`dspark_decode` through ``custom_generate`` (see ``integration.py``), so transformers
still prepares the generation config, logits processors, stopping criteria, attention mask and cache exactly as
for plain decoding. This module only adapts them to a ragged batch and runs
:class:`~hf_dspark.speculation.round.SpeculativeRound` (the same round the serving engine runs) until every row stops:

    prefill(prompt) -> first token;  drafter context <- target features of the prompt
    repeat:  round (draft -> choose widths -> verify -> drafter context)  ->  commit with the stopping rules
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import fields

import torch
from transformers import DynamicCache
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..cpu_kernels import loop_linears
from ..metrics import DSparkStats
from ..modeling.draft_cache import DraftCache
from ..modeling.target_support import raise_if_unsupported_target
from ..modeling.target_taps import TargetFeatureTap
from ..sampling import pick_tokens
from ..scheduling.policies import ThresholdPolicy, VerifyPolicy
from ..speculation.builder import RoundBuilder, holds_croppable_context, raise_if_bad_lookup
from ..kv_cache import growing_cache
from ..speculation.lookup import LookupHistoryKey, LookupProposer
from ..speculation.prefix_cache import CachedPrefix, weights_signature
from ..speculation.processing import RowLogitsProcessor, adapt_for_rows, apply_processors
from ..speculation.ragged_batch import RaggedBatch, fill_from_the_end
from ..speculation.round import SpeculativeRound, prefill
from ..speculation.row_tokens import RowTokens
from ..speculation.shared_state import LONG_MATCH_TOKENS, ScopeState, SharedState, salt_scope, shared_state_for
from ..speculation.verification import verify

logger = logging.getLogger(__name__)


# Decoding methods plain generate switches to on these settings (``GenerationConfig.get_generation_mode``) -> the
# settings to name. The speculative loop runs greedy decoding or sampling only: it would ignore them (greedy tokens).
_OTHER_DECODING_METHODS = {
    GenerationMode.DOLA_GENERATION: "dola_layers (DoLa decoding)",
    GenerationMode.CONTRASTIVE_SEARCH: "penalty_alpha with top_k > 1 (contrastive search)",
    GenerationMode.CONSTRAINED_BEAM_SEARCH: "force_words_ids / constraints (constrained beam search)",
}


def _raise_if_other_decoding_method(generation_config) -> None:
    """Settings that make plain ``generate`` run another decoding method than greedy or sampling. Why here: with an
    assistant transformers picks assisted generation whatever they say (its own assistants ignore them too, with a
    warning), and so reached the DSpark loop, which returned greedy tokens instead."""
    mode = generation_config.get_generation_mode()  # the method plain generate (no assistant) would run
    if mode in _OTHER_DECODING_METHODS:
        raise ValueError(f"{_OTHER_DECODING_METHODS[mode]} selects another decoding method than greedy or sampling, "
                         "which a DSpark assistant_model does not run (it would return greedy tokens instead): drop "
                         "the setting, or drop assistant_model.")


def _raise_if_unsupported(model, generation_config, cache, prompt_length: int) -> None:
    if getattr(generation_config, "num_beams", 1) not in (None, 1):
        raise ValueError("hf-dspark speculative decoding does not support beam search (num_beams > 1); use greedy "
                         "or sampling (do_sample=True), or drop assistant_model for beam search.")
    _raise_if_other_decoding_method(generation_config)
    # NOTE: num_return_sequences > 1 needs nothing here: transformers repeats every row (input ids, attention mask)
    # that many times before it calls dspark_decode, as for plain sampling, and refuses it for greedy decoding
    if model.config.is_encoder_decoder:
        raise ValueError("DSpark drafters support decoder-only targets only.")
    if cache is not None and type(cache) is not DynamicCache:
        raise ValueError(f"hf-dspark needs a DynamicCache for the target (got {type(cache).__name__}): speculative "
                         "decoding must roll back rejected positions, which static/quantized/offloaded caches "
                         "cannot do here. Remove cache_implementation=... or pass a DynamicCache.")
    cached = cache.get_seq_length() if cache is not None else 0
    if cached >= prompt_length:
        raise ValueError(f"The cache passed to generate already holds {cached} positions, and the prompt has "
                         f"{prompt_length} tokens: with a DSpark assistant_model the cache must hold fewer positions "
                         "than the prompt (its first tokens; the rest is prefilled), so the next token is predicted "
                         "from the prompt's last one. Pass the prompt including the tokens still to be processed, or "
                         "no cache.")
    raise_if_unsupported_target(model)


def _raise_if_not_left_padded(attention_mask: torch.Tensor | None) -> None:
    """The ragged batch takes every row to be left-padded (its prompt ends at the last position, its masked
    positions come first): a row whose prompt ends in masked positions, or has masked positions inside it (a pad id
    inside a prompt passed without attention_mask: transformers infers one that masks it), was continued with other
    tokens than plain generate's."""
    if attention_mask is None:
        return
    if not bool(attention_mask[:, -1].all()):
        rows = (attention_mask[:, -1] == 0).nonzero().flatten().tolist()
        raise ValueError(f"attention_mask pads row(s) {rows} on the right (the prompt's last position is masked): "
                         "with a DSpark assistant_model prompts must be left-padded (tokenizer.padding_side = "
                         "'left', as transformers advises for decoder-only models; plain generate only warns).")
    holes = attention_mask.cummax(dim=1).values > attention_mask  # a masked position after an attended one
    if bool(holes.any()):
        rows = holes.any(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"attention_mask masks positions inside the prompt of row(s) {rows}: with a DSpark "
                         "assistant_model only left padding may be masked. Pass the tokenizer's attention_mask "
                         "with the input ids (without one, transformers masks every pad_token_id inside a prompt).")


class StopRules:
    """transformers' stopping criteria for one ragged batch: the max length and EOS ids are checked on the host
    from the committed tokens (no per-token tensor); any other criterion (stop strings, max time, yours) is
    called per committed token on the row's view, as plain generate calls it.

    In lockstep (a batch without an EOS criterion) another criterion does not stop a row: plain ``generate`` pads
    the rows that stopped only when an EOS criterion is present (``has_eos_stopping_criteria``); without one they
    go on decoding, and the whole batch ends at the step where its last row stopped (:meth:`batch_end`)."""

    def __init__(self, criteria, max_length: int | None, num_rows: int = 1):
        self.max_length, self.eos_ids, self.others = max_length, set(), []
        self.lockstep = num_rows > 1 and not any(hasattr(c, "eos_token_id") for c in criteria or [])
        self.num_rows = num_rows
        self.stopped_at: dict[int, int] = {}  # lockstep: row -> its length when a criterion first stopped it
        for criterion in criteria or []:
            if isinstance(criterion, MaxLengthCriteria):
                self.max_length = min(self.max_length or criterion.max_length, criterion.max_length)
            elif isinstance(criterion, EosTokenCriteria):
                self.eos_ids |= {int(t) for t in criterion.eos_token_id.flatten().tolist()}
            else:
                self.others.append(criterion)

    def commit(self, tokens: RowTokens, row: int, new: list[int], kept: list | None = None,
               new_scores: torch.Tensor | None = None) -> tuple[int, bool]:
        """Append ``new`` to the row one token at a time; returns (tokens committed, whether the row stopped).

        A criterion gets ``scores`` as plain ``generate`` hands it: None, or where the call keeps scores
        (``output_scores`` with ``return_dict_in_generate``) the steps' processed logits so far, one [1, V] each:
        ``kept`` (the row's earlier steps) and ``new_scores`` [len(new), V] (this round's)."""
        # the row's earlier steps as [1, V] views, built once a round (not once a token)
        scores = (tuple(s[None] for s in kept) if self.others and kept is not None and new_scores is not None
                  else None)
        for i, token in enumerate(new):
            tokens.append(row, [token])
            length = tokens.lengths[row]
            stop = token in self.eos_ids or (self.max_length is not None and length >= self.max_length)
            if self.others and row not in self.stopped_at:  # every criterion sees every step, the last one too
                if scores is not None:
                    scores = scores + (new_scores[i: i + 1],)
                # torch.as_tensor: a criterion may answer one Python bool (plain generate ORs it into a tensor)
                if any([bool(torch.as_tensor(c(tokens.view(row)[None], scores)).any()) for c in self.others]):
                    if self.lockstep:  # stopped, as plain generate's flag is sticky; its tokens go on
                        self.stopped_at[row] = length
                    else:
                        stop = True
            if stop:
                return i + 1, True
        return len(new), False

    def batch_end(self) -> int | None:
        """Lockstep: once a criterion has stopped every row, the length all rows end at (the length of the row that
        stopped last, where plain generate's batch ends); None before, and outside lockstep."""
        if not self.lockstep or len(self.stopped_at) < self.num_rows:
            return None
        return max(self.stopped_at.values())


def _threshold_policy(drafter, num_tokens: int | None, threshold: float | None) -> VerifyPolicy:
    """Explicit limits: drafts stop at the first slot whose calibrated confidence is below the threshold (the
    drafter config's ``confidence_threshold`` unless given; > 1 never drafts), at most ``num_tokens``."""
    threshold = drafter.config.confidence_threshold if threshold is None else threshold
    return ThresholdPolicy(threshold, num_tokens=num_tokens, max_threshold=math.inf)


def _round_for(model, drafter, *, shared: SharedState, policy, num_tokens, threshold, lookup, scope: ScopeState | None,
               salt: str | None, step_cost, tokenizer, rows: int,
               sequential_top_k) -> tuple[SpeculativeRound, LookupProposer | None]:
    """The round one ``generate`` call runs: explicit limits -> the threshold policy (drafter only); otherwise the
    cost-aware scheduler of the call's salt, remembered across calls, with the lookup proposer unless turned off.
    ``scope`` None: an isolated call (a fresh scheduler and calibrator; no lookup history read or written).

    Assembled by the same builder as the engine's round; what is generate's own: the target's shared lookup
    history under the salt's key and the salt's calibrator and scheduler (``shared_state.py``), a drafter kept
    under a policy that never drafts (the prefix cache keeps its context for later calls), and the shared
    measured step cost for this call's rows."""
    raise_if_bad_lookup(lookup)
    if policy is None and (num_tokens is not None or threshold is not None):
        policy = _threshold_policy(drafter, num_tokens, threshold)
    state = scope if scope is not None else ScopeState()
    key = None if scope is None else LookupHistoryKey.for_model(model, tokenizer, salt_scope(salt))
    builder = RoundBuilder(model, drafter, policy if policy is not None else state.policy_for(drafter, lookup),
                           lookup=lookup, history=shared.history, history_key=key, calibrator=state.calibrator,
                           keep_idle_drafter=True, sequential_top_k=sequential_top_k, verify_fn=verify)
    width = 1 + max(drafter.config.block_size, LONG_MATCH_TOKENS if lookup else 0)
    cost = step_cost if step_cost is not None else (
        lambda: shared.cost_for(model, builder.round_drafter, rows, width))
    return builder.build(cost, observe_time=step_cost is None)


def dspark_decode(model, input_ids: torch.LongTensor, logits_processor=None, stopping_criteria=None,
                  generation_config=None, dspark_drafter=None, dspark_streamer=None, dspark_generator=None,
                  dspark_recorder=None, dspark_num_tokens: int | None = None,
                  dspark_confidence_threshold: float | None = None, dspark_policy: VerifyPolicy | str | None = None,
                  dspark_sequential_top_k: int | None = None, dspark_lookup: bool | str = True,
                  dspark_cache_salt: str | None = None, dspark_isolate: bool = False, dspark_prefix_cache: bool = True,
                  dspark_step_cost=None, dspark_cpu_linears: bool | None = None, dspark_tokenizer=None,
                  dspark_callers_cache: bool = False, **model_kwargs):
    """``custom_generate`` callable: speculative decoding with a DSpark drafter, any batch size.

    By default every round is planned by the cost-aware scheduler (``scheduling.scheduled.ScheduledPolicy``) on
    this machine's measured step cost (profiled once, cached): per row it takes the lookup proposal (drafts
    copied from the row's context or earlier calls' output), the drafter's block, or nothing, and verifies as far as
    it expects to pay, so a call is never much slower than plain decoding. ``dspark_lookup`` (True / False /
    "only": lookup without running the drafter) and ``dspark_step_cost`` (a ``StepCostProfile`` instead of
    measuring) tune it.

    Calls on one target share, by default, what makes an agent's next turn fast (``speculation/shared_state.py``):
    the lookup history (earlier calls' output to copy drafts from), the scheduler's learned acceptance, and, for a
    batch-1 call, its caches, so the next call prefills only the part of its prompt that is new
    (``prefix_cache.py``). A caller
    serving several users passes ``dspark_cache_salt`` (one string per user): calls with different salts share
    nothing, since acceptance timing and cache hits can reveal another user's text. ``dspark_isolate=True`` shares
    nothing at all; ``dspark_prefix_cache=False`` keeps no caches (lookup history still shared).
    On a CPU fp32 target the loop runs its CPU kernels (``cpu_kernels.loop_kernels``) where they measured faster
    than stock on this machine (``cpu_kernels.skinny_pays``, once per process): linears as skinny ``W @ xᵀ``
    products (where stock ``F.linear`` has slow small-M paths, one step and short verifies much cheaper; results
    within its last bits) and verify attention with the query heads of a key/value group folded into the query
    length (no copies of the keys and values); ``dspark_cpu_linears=True`` always runs them, False never.

    Explicit limits switch to the threshold policy, drafter only: ``dspark_num_tokens`` caps the drafts per round
    (0 = no drafting) and ``dspark_confidence_threshold`` stops a row's proposal at the first draft whose
    calibrated confidence is below it (unset: the drafter config's ``confidence_threshold``). ``dspark_policy``
    takes any verify policy (an instance or a registered name); ``dspark_sequential_top_k`` overrides the
    drafter's sequential-bias support (0 = full vocabulary). All are plain ``generate`` keyword arguments.

    ``dspark_recorder`` (optional, e.g. ``evaluation.recorder.RoundRecorder``) gets
    ``observe_round(num_proposed [B], num_accepted [B], num_committed [B], confidence_logits [B, γ] | None)``
    after every verification round: the raw per-round data calibration and evaluation need.

    ``dspark_callers_cache`` (set by the ``generate`` wrapper): the cache in ``model_kwargs`` is one the caller
    passed and keeps; it is never shared through the prefix cache and is left as :func:`_leave_callers_cache` says."""
    drafter = dspark_drafter
    if drafter is None:
        raise ValueError("dspark_decode needs dspark_drafter= (use target.generate(..., assistant_model=draft)).")
    drafter.bind_target(model) if drafter._bound_target[:1] != [model] else None
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    callers_cache = cache if dspark_callers_cache else None
    _raise_if_unsupported(model, generation_config, cache, input_ids.shape[1])
    _raise_if_not_left_padded(model_kwargs.get("attention_mask"))
    call = _GenerateCall(input_ids, model_kwargs.get("attention_mask"), logits_processor, stopping_criteria,
                         generation_config, drafter, dspark_streamer, dspark_recorder)
    raise_if_bad_salt(dspark_cache_salt, dspark_isolate)
    lookup_mode = dspark_lookup if dspark_recorder is None else False
    # lookup only: the drafter never runs, so no context is built for it and the caches kept are a drafter-less
    # entry (a later drafting call must not take a drafter context that stops at this call's prompt)
    call.context_drafter = None if lookup_mode == "only" else drafter
    # the target's shared state, looked up once: a call in flight when forget(target) / disable(target) runs goes on
    # with what it started with (one round lock with the calls sharing its scheduler) and leaves nothing in the state
    # the target is given afterwards
    state = shared_state_for(model)
    scope = None if dspark_isolate else state.scope(dspark_cache_salt)
    # a caller's cache is theirs: kept in the store, a later call would crop and extend it under their hands
    keeps_prefixes = dspark_prefix_cache and scope is not None and callers_cache is None
    prefix_key = (_prefix_key(state, call.context_drafter, call, cache, dspark_cache_salt) if keeps_prefixes
                  else None)
    weights, reused = (), None
    if prefix_key is not None:
        weights = weights_signature(model, *[m for m in (call.context_drafter,) if m is not None])
        reused = state.prefixes.take(prefix_key, call.tokens.host[0], weights)
    cache = cache if cache is not None else growing_cache(model.config)
    do_sample = bool(generation_config.do_sample)
    linears = loop_linears(dspark_cpu_linears, model, call.context_drafter)
    tap = (TargetFeatureTap(model, drafter.config.target_layer_ids) if call.context_drafter is not None
           else contextlib.nullcontext())
    with linears, tap as tap, torch.no_grad():
        batch, active = call.prefill(model, cache, tap, do_sample, dspark_generator, reused=reused)
        round_, lookup = _round_for(model, drafter, shared=state, policy=dspark_policy,
                                    num_tokens=dspark_num_tokens, threshold=dspark_confidence_threshold,
                                    lookup=lookup_mode,
                                    scope=scope, salt=dspark_cache_salt, step_cost=dspark_step_cost,
                                    tokenizer=dspark_tokenizer, rows=len(call.tokens),
                                    sequential_top_k=dspark_sequential_top_k)
        shared = state.round_lock  # the policy, calibrator and lookup history other calls use too
        with shared:
            call.start_lookup(lookup)
        while active:
            with shared:
                result = round_.run(batch, call.processor(active), call.budgets(active), do_sample=do_sample,
                                    generator=dspark_generator, tap=tap, row_ids=active)
            # NOTE: committing touches only this call's objects (its rows, stats and lookup proposer), and runs the
            # caller's code (streamer, stopping criteria, recorder), which may wait on another call on this target
            # (a streamer with back-pressure): outside the lock, as plain generate holds none
            still = call.commit_round(active, result)
            if not still and prefix_key is not None:  # the call is done: its caches serve the scope's next call
                state.prefixes.put(prefix_key, call.cached_prefix(batch, round_.drafter, weights))
            kept = fill_from_the_end(len(active), set(range(len(active))) - set(still))  # rows in any order
            batch.keep(kept)
            active = [active[i] for i in kept]
            if len(active) > 1:  # holes not shared by every row: pack the rows once they are half the cache
                batch.compact_if_needed(1 + round_.max_drafts, slot_budget=math.inf, max_hole_fraction=0.5)
        with shared:
            call.end_lookup()
        if dspark_step_cost is None and round_.resolved_cost is not None:
            state.review_cost(round_.resolved_cost, round_.fastest_step_ratio)
    if callers_cache is not None:
        _leave_callers_cache(callers_cache, call.tokens)
    return call.finish(model)


#: The attribute :func:`_leave_callers_cache` marks a caller's cache with when no later call may take it (its value:
#: the batch size of the call that left it so); the ``generate`` wrapper refuses such a cache.
SPENT_CACHE_MARK = "_hf_dspark_spent_by_batch"


def _leave_callers_cache(cache, tokens: RowTokens) -> None:
    """A cache the caller passed in, left for their next call (transformers' "continue with the cache" pattern).

    Batch 1: as plain ``generate`` leaves it, holding every token's K/V but the last one's. Why crop: the last round
    also cached drafts accepted after the token that stopped the row (EOS, a stop string), and a next turn passing
    this cache would attend to them instead of its own tokens. Batch > 1: rejected drafts stay as masked holes and
    finished rows were dropped from it, which no later call could tell from a cache of its prompt: it is marked,
    and the ``generate`` wrapper refuses it (never other tokens)."""
    if len(tokens) == 1:
        drop = cache.get_seq_length() - (tokens.lengths[0] - 1)
        if drop > 0:
            cache.crop(-drop)  # transformers >= 5.24: a negative count is the number of slots to drop
    else:
        setattr(cache, SPENT_CACHE_MARK, len(tokens))


def raise_if_bad_salt(salt, isolate) -> None:
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"dspark_cache_salt must be a string (one per user or tenant) or None, got {salt!r}")
    if not isinstance(isolate, bool):
        raise ValueError(f"dspark_isolate must be True or False, got {isolate!r}")
    if isolate and salt is not None:
        raise ValueError("dspark_isolate=True shares nothing, so a dspark_cache_salt has nothing to separate: give "
                         "one or the other.")


def _prefix_key(state: SharedState, drafter, call: "_GenerateCall", cache, salt: str | None):
    """The prefix-cache key of this call, or None where caches are not kept: batch > 1 or a padded prompt (slots
    would not be positions), a caller's own non-empty cache, an autoregressive drafter (its context state describes
    the last entry and cannot be cropped)."""
    if len(call.tokens) != 1 or call.tokens.num_pad[0]:
        return None
    if cache is not None and cache.get_seq_length():
        return None
    if not holds_croppable_context(drafter):
        return None
    return state.prefix_key(salt, drafter)


class _GenerateCall:
    """One ``generate`` call's rows: their tokens and stopping rules, per-row processors, the recorded scores, the
    stats, the streamer and recorder, and the rows' lookup index. The round itself is the shared one."""

    def __init__(self, input_ids, attention_mask, logits_processor, stopping_criteria, generation_config, drafter,
                 streamer, recorder):
        self.input_ids, self.config, self.drafter = input_ids, generation_config, drafter
        self.context_drafter = drafter  # the drafter whose context the call builds (None: lookup only)
        self.streamer, self.recorder, self.lookup = streamer, recorder, None
        self.mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(torch.long)
        bsz = input_ids.shape[0]
        self.stats = drafter.stats = DSparkStats.new(drafter.config.block_size)
        self.stop = StopRules(stopping_criteria, generation_config.max_length, num_rows=bsz)
        self.max_length = self.stop.max_length or input_ids.shape[1] + (generation_config.max_new_tokens or 0)
        self.row_processors = adapt_for_rows(logits_processor, input_ids, (self.mask.cumsum(-1) == 0).sum(-1).tolist())
        reads_ids = not RowLogitsProcessor(self.row_processors[0] if self.row_processors else None, []).ids_independent
        self.tokens = RowTokens(input_ids, self.mask, capacity=self.max_length + drafter.config.block_size + 2,
                                mirror=reads_ids or bool(self.stop.others))
        returns_dict = bool(generation_config.return_dict_in_generate)
        self.scores = [[] for _ in range(bsz)] if returns_dict and generation_config.output_scores else None
        self.raw_logits = [[] for _ in range(bsz)] if returns_dict and generation_config.output_logits else None
        if streamer is not None:
            if bsz > 1:
                raise ValueError("Streamers support batch size 1 only (as in transformers).")
            streamer.put(input_ids.cpu())

    def prefill(self, model, cache, tap, do_sample: bool, generator,
                reused: tuple[CachedPrefix, int] | None = None) -> tuple[RaggedBatch, list[int]]:
        """The prompts through the target, the first token of every row, the batch of rows still running.
        ``reused``: an earlier call's caches holding this (batch-1) prompt's first ``r`` positions; only the rest
        is prefilled."""
        start = time.perf_counter()
        tokens, mask = self.tokens, self.mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        first_processor = RowLogitsProcessor(self.row_processors, tokens=tokens, rows=list(range(len(tokens))))
        processed = {}

        def pick_first(logits: torch.Tensor) -> torch.Tensor:
            processed["logits"] = first_processor(self.input_ids[:, :0], logits.clone())
            return pick_tokens(processed["logits"], do_sample, generator)

        own_lengths = [tokens.prompt_length - p for p in tokens.num_pad]
        # a cache that already holds the prompt's first positions (the caller's, as plain generate honours it, or
        # an earlier call's from the prefix cache) is extended with the rest only
        skip, draft_cache = cache.get_seq_length(), DraftCache()
        if reused is not None:
            entry, skip = reused
            cache = entry.cache
            draft_cache = entry.draft_cache if entry.draft_cache is not None else DraftCache()
        raw, first, draft_cache = prefill(model, self.input_ids[:, skip:], positions[:, skip:], cache,
                                          pick_first=pick_first, attention_mask=mask, tap=tap,
                                          drafter=self.context_drafter,
                                          draft_cache=draft_cache, valid=mask[:, skip:].bool(),
                                          counts=mask[:, skip:].sum(-1).tolist())
        self.stats.prompt_tokens += sum(own_lengths)
        self.stats.reused_prompt_tokens += sum(own - int(n) for own, n in zip(own_lengths, mask[:, skip:].sum(-1)))
        draft_cache.reserve(self.max_length + self.drafter.config.block_size + 1)
        self.stats.prefill_seconds += time.perf_counter() - start
        active = []
        for b, token in enumerate(first.tolist()):
            _, finished = self.stop.commit(tokens, b, [token], self._kept(b), processed["logits"][b:b + 1])
            self._record(b, processed["logits"][b:b + 1], raw[b:b + 1])
            if not finished:
                active.append(b)
        ended = self._end_in_lockstep()
        active = [b for b in active if b not in ended]
        if self.streamer is not None:
            self.streamer.put(first.cpu())
        batch = RaggedBatch(model.config, self.input_ids.device)
        batch.start(cache, mask, first, positions[:, -1] + 1, host_valid=own_lengths, host_positions=own_lengths,
                    draft_cache=draft_cache)
        batch.keep(active)
        return batch, active

    def cached_prefix(self, batch: RaggedBatch, drafter, weights: tuple) -> CachedPrefix:
        """This (batch-1, finished) call's caches and the tokens at their positions, the drafter context complete
        (no drafter context at all for a lookup-only call)."""
        if drafter is None:
            return CachedPrefix(list(self.tokens.host[0]), batch.cache, None, weights)
        batch.flush_context(drafter)
        return CachedPrefix(list(self.tokens.host[0]), batch.cache, batch.draft_cache, weights)

    def processor(self, active: list[int]) -> RowLogitsProcessor:
        return RowLogitsProcessor([self.row_processors[b] for b in active], tokens=self.tokens, rows=active)

    def budgets(self, active: list[int]) -> list[int]:
        return [self.max_length - self.tokens.lengths[b] for b in active]

    def commit_round(self, active: list[int], result) -> list[int]:
        """Commit each row's tokens with the stopping rules; returns the batch positions of rows still running."""
        committed, still = [], []
        for i, b in enumerate(active):
            n, finished = self.stop.commit(self.tokens, b, result.tokens[i], self._kept(b), result.target_logits[i])
            committed.append(n)
            if self.scores is not None or self.raw_logits is not None:  # slices only when someone keeps them
                self._record(b, result.target_logits[i, :n], result.raw_logits[i, :n])
            if self.lookup is not None:
                self.lookup.commit(b, result.tokens[i][:n])
            if not finished:
                still.append(i)
        ended = self._end_in_lockstep()
        still = [i for i in still if active[i] not in ended]
        stats = self.stats
        stats.observe_round(result.num_drafts, result.num_accepted, committed, result.sources)
        stats.draft_seconds += result.draft_seconds
        stats.verify_seconds += result.verify_seconds
        if self.recorder is not None:
            block = result.block
            self.recorder.observe_round(torch.tensor(result.num_drafts), torch.tensor(result.num_accepted),
                                        torch.tensor(committed), block.confidence_logits if block is not None else None)
        if self.streamer is not None and committed[0]:
            self.streamer.put(torch.tensor(result.tokens[0][: committed[0]]))
        return still

    def _end_in_lockstep(self) -> set[int]:
        """Lockstep (see :class:`StopRules`): once every row has stopped, every row ends at the batch's end, as in
        plain generate; returns the rows that reached it (cut back to it: rows run ahead of one another, and the
        tokens past the end are ones plain generate never decodes). Rows still short of it go on until it."""
        end = self.stop.batch_end()
        if end is None:
            return set()
        self.max_length = self.stop.max_length = min(self.max_length, end)
        ended = set()
        for row in range(len(self.tokens)):
            if self.tokens.lengths[row] >= end:
                self.tokens.truncate(row, end)
                for per_row in (self.scores, self.raw_logits):
                    if per_row is not None:
                        del per_row[row][end - self.tokens.prompt_length:]
                ended.add(row)
        # NOTE: the lookup proposer keeps the cut tokens as history: they only ever become drafts, which are verified
        return ended

    def start_lookup(self, lookup) -> None:
        self.lookup = lookup
        if lookup is not None:
            for b in range(len(self.tokens)):
                lookup.start_row(b, self.tokens.host[b][self.tokens.num_pad[b]:])  # own prompt + first token

    def end_lookup(self) -> None:
        if self.lookup is not None:
            for b in range(len(self.tokens)):  # this call's text becomes lookup history for later calls with its key
                self.lookup.end_row(b, keep_in_history=True)

    def _kept(self, row: int) -> list | None:
        return None if self.scores is None else self.scores[row]

    def _record(self, row: int, processed: torch.Tensor, raw: torch.Tensor) -> None:
        if self.scores is not None:
            self.scores[row].extend(processed)
        if self.raw_logits is not None:
            self.raw_logits[row].extend(raw)

    def finish(self, model):
        if self.streamer is not None:
            self.streamer.end()
        self.stats.log()
        config = self.config
        pad, eos = config._pad_token_tensor, config._eos_token_tensor
        pad_id = int(pad) if pad is not None else (int(eos.flatten()[0]) if eos is not None else 0)
        sequences = self.tokens.sequences(pad_id, self.input_ids.device)
        if not config.return_dict_in_generate:
            return sequences
        self._record_after_stop(model, pad_id)
        return _build_output(sequences, self.scores, self.raw_logits)

    @torch.no_grad()
    def _record_after_stop(self, model, pad_id: int) -> None:
        """Scores and logits of the steps after a row stopped, as plain ``generate`` returns them.

        Why: plain ``generate`` keeps decoding a finished row with the pad token as input until the batch ends, and
        returns the (processed) logits of those steps; ``compute_transition_scores(..., normalize_logits=True)``
        is finite there. The speculative loop drops finished rows, so their remaining steps are computed here in
        one target forward over the row's tokens followed by pads, processed with the row's own processors."""
        per_row = self.scores if self.scores is not None else self.raw_logits
        if per_row is None:
            return
        steps = max(len(r) for r in per_row)
        for row, recorded in enumerate(per_row):
            missing = steps - len(recorded)
            if not missing:
                continue
            own = self.tokens.host[row][self.tokens.num_pad[row]:]
            ids = torch.tensor([own + [pad_id] * (missing - 1)], device=self.input_ids.device)
            raw = model(input_ids=ids, logits_to_keep=missing).logits[0].float()  # [missing, V]
            for step in range(missing):
                processed = apply_processors(self.row_processors[row], ids[:, :len(own) + step],
                                             raw[step:step + 1].clone())
                self._record(row, processed, raw[step:step + 1])


def _stack_steps(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    steps = max(len(r) for r in per_row)
    vocab = next(t for r in per_row for t in r).shape[-1]
    filler = torch.full((vocab,), float("-inf"))
    return tuple(torch.stack([r[t].reshape(-1) if t < len(r) else filler.to(r[0].device) for r in per_row])
                 for t in range(steps))


def _build_output(sequences, scores, raw_logits):
    kwargs = {"sequences": sequences}
    if scores is not None:
        kwargs["scores"] = _stack_steps(scores)
    if raw_logits is not None:
        kwargs["logits"] = _stack_steps(raw_logits)
    names = {f.name for f in fields(GenerateDecoderOnlyOutput)}
    # The target cache holds masked holes from rejected drafts, so it is not handed back for reuse.
    return GenerateDecoderOnlyOutput(**{k: v for k, v in kwargs.items() if k in names})
