"""Speculative decoding loop for any batch size, plugged into the stock ``GenerationMixin.generate``.

``target.generate(**inputs, assistant_model=draft)`` reaches :func:`dspark_decode` through
``generate(custom_generate=dspark_decode)`` (see ``integration.py``), so transformers still prepares the
generation config, logits processors, stopping criteria, attention mask and cache exactly as for plain
decoding; this loop replaces only the token-by-token part:

    prefill(prompt) -> first token;  drafter context <- target features of the prompt
    repeat:  draft γ tokens per row (drafter)  ->  one target forward over [anchor, drafts] for all rows
             -> verify()  ->  commit accepted + recovered/bonus  ->  stopping criteria token by token
             -> drafter context <- target features of the committed positions

Rows of a batch accept different numbers of tokens per round. Instead of re-aligning the batch, each row keeps
its own positions and the target cache keeps rejected slots as *holes* masked out of attention (trailing holes
shared by all rows are cropped); finished rows leave the batch so they stop costing compute.
"""

from __future__ import annotations

import logging
import time
from dataclasses import fields

import torch
from transformers import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..metrics import DSparkStats
from ..modeling.modeling import DraftCache
from ..modeling.target_taps import TargetFeatureTap
from .processing import RowLogitsProcessor, adapt_for_rows
from .ragged_batch import cache_kwarg, crop_trailing_holes
from .verification import verify

logger = logging.getLogger(__name__)


def _raise_if_unsupported(model, generation_config, cache) -> None:
    if getattr(generation_config, "num_beams", 1) not in (None, 1):
        raise ValueError("hf-dspark speculative decoding does not support beam search (num_beams > 1); use greedy "
                         "or sampling (do_sample=True), or drop assistant_model for beam search.")
    if getattr(generation_config, "num_return_sequences", 1) not in (None, 1):
        raise ValueError("num_return_sequences > 1 is not supported with a DSpark assistant; repeat the prompt in "
                         "the batch instead (batches of any size are supported).")
    if model.config.is_encoder_decoder:
        raise ValueError("DSpark drafters support decoder-only targets only.")
    if cache is not None and type(cache) is not DynamicCache:
        raise ValueError(f"hf-dspark needs a DynamicCache for the target (got {type(cache).__name__}): speculative "
                         "decoding must roll back rejected positions, which static/quantized/offloaded caches "
                         "cannot do here. Remove cache_implementation=... or pass a DynamicCache.")
    if any(getattr(model.config.get_text_config(), "layer_types", None) or []) and any(
            t != "full_attention" for t in model.config.get_text_config().layer_types):
        raise ValueError("Targets with sliding-window or linear-attention layers are not supported yet: rejected "
                         "draft positions cannot be rolled back inside a sliding window cache.")


class _Rows:
    """Per-row bookkeeping of a ragged speculative batch (python lists: rows diverge every round)."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int):
        self.prompt_rows = list(input_ids)  # left-padded prompt rows, as plain batched generate sees them
        self.num_pad = (attention_mask.cumsum(-1) == 0).sum(-1).tolist()  # leading padding per row
        self.generated: list[list[int]] = [[] for _ in self.prompt_rows]
        self.scores: list[list[torch.Tensor]] = [[] for _ in self.prompt_rows]
        self.raw_logits: list[list[torch.Tensor]] = [[] for _ in self.prompt_rows]
        self.finished = [False] * len(self.prompt_rows)
        self.pad_token_id = pad_token_id

    def view(self, row: int) -> torch.Tensor:
        """Row's sequence as plain batched generate would hold it: padded prompt + generated so far."""
        gen = torch.tensor(self.generated[row], dtype=torch.long, device=self.prompt_rows[row].device)
        return torch.cat([self.prompt_rows[row], gen])

    def own_view(self, row: int) -> torch.Tensor:
        """The row's own tokens, without the batch's left padding: what logits processors see when the row is
        generated alone (a repetition penalty must not count padding as repeated content)."""
        return self.view(row)[self.num_pad[row]:]

    def sequences(self) -> torch.Tensor:
        width = max(len(g) for g in self.generated)
        rows = [torch.cat([p, torch.tensor(g + [self.pad_token_id] * (width - len(g)), dtype=torch.long,
                                           device=p.device)]) for p, g in zip(self.prompt_rows, self.generated)]
        return torch.stack(rows)


def _commit(rows: _Rows, row: int, tokens: list[int], stopping_criteria, scores=None, raw=None) -> int:
    """Append tokens one at a time, checking stopping criteria after each (as plain generate does).
    Returns how many were committed before the row stopped (or all)."""
    for i, token in enumerate(tokens):
        rows.generated[row].append(token)
        if scores is not None:
            rows.scores[row].append(scores[i])
        if raw is not None:
            rows.raw_logits[row].append(raw[i])
        if stopping_criteria is not None and bool(stopping_criteria(rows.view(row)[None], None).any()):
            rows.finished[row] = True
            return i + 1
    return len(tokens)


def _sample_or_argmax(logits: torch.Tensor, do_sample: bool, generator) -> torch.Tensor:
    if do_sample:
        return torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator).squeeze(-1)
    return logits.argmax(-1)


def dspark_decode(model, input_ids: torch.LongTensor, logits_processor=None, stopping_criteria=None,
                  generation_config=None, dspark_drafter=None, dspark_streamer=None, dspark_generator=None,
                  dspark_recorder=None, dspark_num_tokens: int | None = None,
                  dspark_confidence_threshold: float | None = None, tokenizer=None, **model_kwargs):
    """``custom_generate`` callable: speculative decoding with a DSpark drafter, any batch size.

    ``dspark_num_tokens`` fixes the drafts proposed per round (≤ block size; default: the whole block) and
    ``dspark_confidence_threshold`` stops a row's proposal at the first draft whose calibrated confidence is below
    it (default: the drafter config's ``confidence_threshold``); both are plain ``generate`` keyword arguments.

    ``dspark_recorder`` (optional, e.g. ``evaluation.recorder.RoundRecorder``) gets
    ``observe_round(num_proposed [B], num_accepted [B], num_committed [B], confidence_logits [B, γ] | None)``
    after every verification round: the raw per-round data calibration and evaluation need."""
    drafter = dspark_drafter
    if drafter is None:
        raise ValueError("dspark_decode needs dspark_drafter= (use target.generate(..., assistant_model=draft)).")
    drafter.bind_target(model) if drafter._bound_target[:1] != [model] else None
    cache_name = cache_kwarg(model)
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    _raise_if_unsupported(model, generation_config, cache)
    cache = cache if cache is not None else DynamicCache(config=model.config)
    do_sample = bool(generation_config.do_sample)
    want_scores = bool(generation_config.output_scores) and bool(generation_config.return_dict_in_generate)
    want_logits = bool(generation_config.output_logits) and bool(generation_config.return_dict_in_generate)
    pad = generation_config._pad_token_tensor
    eos = generation_config._eos_token_tensor
    pad_id = int(pad) if pad is not None else (int(eos.flatten()[0]) if eos is not None else 0)

    stats = DSparkStats.new(drafter.config.block_size)
    drafter.stats = stats
    bsz = input_ids.shape[0]
    device = input_ids.device
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask.to(torch.long)
    rows = _Rows(input_ids, mask, pad_id)
    row_processors = adapt_for_rows(logits_processor, rows.num_pad)  # per original row, for unpadded views
    if dspark_streamer is not None:
        if bsz > 1:
            raise ValueError("Streamers support batch size 1 only (as in transformers).")
        dspark_streamer.put(input_ids.cpu())

    with TargetFeatureTap(model, drafter.config.target_layer_ids) as tap, torch.no_grad():
        # -- prefill ------------------------------------------------------------------------------------
        start = time.perf_counter()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1, **{cache_name: cache})
        raw = out.logits[:, -1].float()
        processed = RowLogitsProcessor(row_processors, [rows.own_view(b) for b in range(bsz)])(
            input_ids[:, :0], raw.clone())
        first = _sample_or_argmax(processed, do_sample, dspark_generator)
        next_ids = torch.cat([input_ids[:, 1:], first[:, None]], dim=1)  # the token after each prompt position
        draft_cache = drafter.extend_context(DraftCache(), tap.features(), positions, mask.bool(), next_ids)
        stats.prefill_seconds += time.perf_counter() - start
        for b in range(bsz):
            _commit(rows, b, [int(first[b])], stopping_criteria, processed[b:b + 1], raw[b:b + 1])
        if dspark_streamer is not None:
            dspark_streamer.put(first.cpu())

        active = torch.tensor([b for b in range(bsz) if not rows.finished[b]], dtype=torch.long, device=device)
        if len(active) < bsz:
            cache.batch_select_indices(active)
            draft_cache = draft_cache.select_rows(active)
            mask = mask[active]
        anchor = first[active]
        anchor_pos = positions[active, -1] + 1
        max_length = generation_config.max_length

        while len(active):
            act = active.tolist()
            # slot k of the draft and position k of the verify pass see the same ids: own prefix + drafts[:k]
            processor = RowLogitsProcessor([row_processors[b] for b in act], [rows.own_view(b) for b in act])
            # -- draft ----------------------------------------------------------------------------------
            start = time.perf_counter()
            # tokens still allowed, counted on the padded view as max_length is (no tensor built per row)
            budget = torch.tensor([max_length - len(rows.prompt_rows[b]) - len(rows.generated[b]) for b in act],
                                  device=device)
            block = drafter.draft_block(draft_cache, anchor, anchor_pos, do_sample=do_sample,
                                        logits_processor=processor, generator=dspark_generator,
                                        num_tokens=dspark_num_tokens, confidence_threshold=dspark_confidence_threshold)
            num_drafts = torch.minimum(block.num_drafts, (budget - 1).clamp(min=0))
            width = int(num_drafts.max()) + 1
            drafts = block.tokens[:, :width - 1]
            stats.draft_seconds += time.perf_counter() - start
            # -- verify: one target forward over [anchor, drafts] for every row -------------------------
            start = time.perf_counter()
            verify_ids = torch.cat([anchor[:, None], drafts], dim=1)
            verify_pos = anchor_pos[:, None] + torch.arange(width, device=device)
            full_mask = torch.cat([mask, torch.ones_like(verify_ids)], dim=1)
            out = model(input_ids=verify_ids, attention_mask=full_mask, position_ids=verify_pos, use_cache=True,
                        logits_to_keep=width, **{cache_name: cache})
            raw = out.logits[:, -width:].float()
            target_logits = processor.process_positions(drafts, raw.clone())
            probs = block.draft_probs[:, :width - 1] if do_sample else None
            result = verify(drafts, num_drafts, target_logits, probs, do_sample=do_sample, generator=dspark_generator)
            stats.verify_seconds += time.perf_counter() - start
            # -- commit ---------------------------------------------------------------------------------
            committed = torch.zeros_like(num_drafts)
            streamed = []
            for i, b in enumerate(act):
                n = int(result.num_accepted[i]) + 1
                tokens = result.output_tokens[i, :n].tolist()
                committed[i] = _commit(rows, b, tokens, stopping_criteria,
                                       target_logits[i, :n] if want_scores else None, raw[i, :n] if want_logits else None)
                streamed = tokens[: int(committed[i])]
            stats.observe_round(num_drafts, result.num_accepted, committed)
            if dspark_recorder is not None:
                dspark_recorder.observe_round(num_drafts, result.num_accepted, committed, block.confidence_logits)
            if dspark_streamer is not None and streamed:
                dspark_streamer.put(torch.tensor(streamed))
            # target KV of anchor + accepted drafts stays valid; the rest of this round's slots become holes
            kept = torch.arange(width, device=device)[None, :] <= result.num_accepted[:, None]
            mask = torch.cat([mask, kept.long()], dim=1)
            next_ids = torch.where(kept, result.output_tokens[:, :width], 0)  # accepted drafts, then the new token
            draft_cache = drafter.extend_context(draft_cache, tap.features()[:, :width], verify_pos, kept, next_ids)
            anchor, anchor_pos = result.next_tokens, anchor_pos + result.num_accepted + 1
            # -- shrink: drop finished rows, crop trailing holes shared by every row ---------------------
            still = torch.tensor([not rows.finished[b] for b in act], dtype=torch.bool, device=device)
            if not bool(still.all()):
                keep_idx = still.nonzero().squeeze(-1)
                active, anchor, anchor_pos, mask = active[keep_idx], anchor[keep_idx], anchor_pos[keep_idx], mask[keep_idx]
                if len(active):
                    cache.batch_select_indices(keep_idx)
                    draft_cache = draft_cache.select_rows(keep_idx)
            if len(active):
                mask = crop_trailing_holes(cache, mask)

    if dspark_streamer is not None:
        dspark_streamer.end()
    stats.log()
    sequences = rows.sequences()
    if not generation_config.return_dict_in_generate:
        return sequences
    return _build_output(sequences, rows, want_scores, want_logits, cache)


def _stack_steps(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    steps = max(len(r) for r in per_row)
    vocab = next(t for r in per_row for t in r).shape[-1]
    filler = torch.full((vocab,), float("-inf"))
    return tuple(torch.stack([r[t].reshape(-1) if t < len(r) else filler.to(r[0].device) for r in per_row])
                 for t in range(steps))


def _build_output(sequences, rows: _Rows, want_scores: bool, want_logits: bool, cache):
    kwargs = {"sequences": sequences}
    if want_scores:
        kwargs["scores"] = _stack_steps(rows.scores)
    if want_logits:
        kwargs["logits"] = _stack_steps(rows.raw_logits)
    names = {f.name for f in fields(GenerateDecoderOnlyOutput)}
    # The target cache holds masked holes from rejected drafts, so it is not handed back for reuse.
    return GenerateDecoderOnlyOutput(**{k: v for k, v in kwargs.items() if k in names})
