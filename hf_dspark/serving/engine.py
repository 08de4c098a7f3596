"""DSparkEngine: continuous batching with confidence-scheduled, load-aware speculative verification.

transformers' own continuous batching assumes one new token per request per step all the way down (scheduler,
IO tensors, sampler, cache bookkeeping; notes/transformers_integration.md §4), so speculation cannot be added
there without a fork. This engine is small and transformers-native instead: plain ``DynamicCache``, stock
model forwards, the drafter's ``draft_block`` and the one ``verify`` routine that ``generate`` uses too.

One engine step (paper Algorithm 1 around it):

    admit waiting requests within the slot budget -> prefill them (similar lengths together, long ones chunked)
      -> stack onto the batch                                     (``admission.py``, ``batch.py``)
    draft γ tokens for every running request                      (one batched drafter pass)
    ℓ_r = policy.choose(PolicyInputs(calibrated c_{r,j}, drafts available, step cost))  (load-aware lengths)
    one target forward over [anchor_r, x_{r,1..ℓ_r}] for all rows  (padded to 1 + max ℓ; B = Σ(1 + ℓ_r))
    verify() -> commit accepted + recovered/bonus tokens, stream them, stop at EOS / max_new_tokens
    rejected slots become masked holes; drafter context <- target features of the committed positions
    retire finished and cancelled requests

Memory is reserved at admission: a request needs prompt + max_new_tokens + γ + 1 cache slots, the padded batch
costs rows × widest reservation, and the batch compacts its holes before it could outgrow that. A request
that can never fit is rejected by ``submit``; the others wait. The loop therefore never allocates beyond
``max_batch_tokens`` slots. A failing prefill fails only its request; a failing decode step fails only the
request it can be traced to, and the others resume from their committed tokens (``fault_isolation.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence

import torch

from ..cpu_kernels import loop_linears, skinny_applies, skinny_pays
from ..modeling.architectures import architecture_of
from ..modeling.target_support import raise_if_unsupported_target
from ..modeling.target_taps import TargetFeatureTap
from ..scheduling.policies import VerifyPolicy
from ..scheduling.cost_tables import SPSProfile, StepCostProfile
from ..speculation.builder import RoundBuilder, holds_croppable_context
from ..speculation.lookup import LookupHistory, LookupHistoryKey
from ..speculation.prefix_cache import PREFIX_CACHE_BYTES
from ..speculation.shared_state import salt_scope
from .admission import Admission
from .batch import JoiningRows, RunningBatch
from .fault_isolation import DecodeQuarantine
from .metrics import EngineMetrics
from .prefixes import RequestPrefixes
from .processing import BatchLogitsProcessor
from .requests import (
    FinishReason,
    Request,
    RequestHandle,
    RequestOutput,
    RequestRejectedError,
    SamplingParams,
    encode_prompt,
    new_request_id,
    raise_if_never_fits,
    resolve_sampling_params,
    stop_token_ids,
    target_stop_token_ids,
    unapplied_generation_settings,
)
from .step_cost_source import CostSource, EngineStepCost

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int] | torch.Tensor | Sequence[Mapping[str, str]]


class DSparkEngine:
    """Serve many requests at once with a DSpark drafter (see the module docstring for one step).

    Args:
        target: the transformers causal LM (full-attention decoder).
        drafter: a ``DSparkDraftModel`` for ``target``; may be None with ``policy="none"`` (or lookup only).
        policy (`str | VerifyPolicy`, defaults to "scheduled"): verify-length policy name from
            ``hf_dspark.scheduling.available_policies()`` (kwargs in ``policy_kwargs``) or an instance.
        max_batch_tokens (`int`, defaults to 32768): KV slots the running batch may hold, counted as the padded
            cache holds them: admitted requests × the widest reservation (prompt + max_new_tokens + γ + 1).
        max_running_requests (`int`, defaults to 64): requests decoding (or prefilling) at once.
        max_request_tokens (`int`, defaults to the target's max positions, within max_batch_tokens): cap on
            prompt + max_new_tokens of one request; longer requests are rejected by ``submit``.
        max_prefill_tokens (`int`, defaults to 1024): prompt tokens prefilled per step (long prompts span steps).
        sps (`StepCostProfile | SPSProfile | {B: steps/s} | None`): the step cost. None measures the engine's
            own step on first use by a cost-aware policy (``profile_step_cost``: drafter pass for R requests and
            padded verify of R rows × W tokens, R up to max_running_requests, W up to 1 + γ; cached on disk in
            ``sps_cache_dir``). An SPS(B) table is read as verify(R, W) = 1/SPS(R·W) with no drafter cost.
        tokenizer: needed for text / chat prompts and for ``RequestOutput.text``.
        max_hole_fraction (`float`, defaults to 0.5): compact the batch cache when more of its columns are holes
            (or when the next round would take it past its rows' share of ``max_batch_tokens``).
        log_interval_s (`float`, defaults to 30): how often the engine logs its metrics while busy.
        lookup (`bool`, defaults to True): offer training-free lookup proposals (drafts copied from each request's
            own prompt and output, and from earlier requests of the same ``SamplingParams.cache_salt``) to a
            policy that can weigh them (``scheduled``); with ``drafter=None`` the engine serves lookup only.
        lookup_history_tokens (`int`, defaults to 65536): tokens of finished requests kept for lookup (all salts
            together; 0 = none). Requests share it by default; requests with different ``cache_salt`` never
            (acceptance timing can reveal another user's text: give each user / tenant its own salt), and an
            ``isolate`` request neither reads nor writes it.
        prefix_cache (`bool`, defaults to True): a finished request leaves its target and drafter caches for the
            next request of its salt, which prefills only the part of its prompt that is new (an agent's
            conversation is not prefilled again every turn; ``generate`` does the same). Bounded
            (``prefix_cache_bytes``, 8 entries, LRU), never across salts or changed weights, never for ``isolate``
            requests; not for autoregressive drafters. The scheduler plans the whole batch, so its learned
            acceptance is the engine's, not a salt's: co-scheduled requests shape each other's timing whatever
            their salts, as in any batching server.
        prefix_cache_bytes (`int`, defaults to 512 MiB): memory the kept caches may hold.
        cpu_linears (`bool`, *optional*): on a CPU fp32 target, steps (and the step-cost profile) run the
            loop's CPU kernels (``cpu_kernels.loop_kernels``: skinny ``W @ xᵀ`` linears — where stock ``F.linear``
            has slow small-M paths a few rows per forward cost far less, results within its last bits — and
            GQA-folded verify attention). None (default): where they measured faster than stock on this machine
            (``cpu_kernels.skinny_pays``); True always; False keeps the stock kernels.
    """

    # rounds of target features kept unprojected while the scheduler skips the drafter (bounds their memory)
    max_deferred_steps: int = 64

    def __init__(self, target, drafter=None, policy: str | VerifyPolicy = "scheduled", *,
                 policy_kwargs: Mapping | None = None, max_batch_tokens: int = 32768, max_running_requests: int = 64,
                 max_request_tokens: int | None = None, max_prefill_tokens: int = 1024, sps: CostSource = None,
                 sps_cache_dir: str | None = None, tokenizer=None, max_hole_fraction: float = 0.5,
                 log_interval_s: float = 30.0, lookup: bool = True, lookup_history_tokens: int = 65_536,
                 prefix_cache: bool = True, prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
                 cpu_linears: bool | None = None):
        raise_if_unsupported_target(target, "DSparkEngine")
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        # The round is assembled as generate's is (speculation/builder.py); the engine's own: a drafter the policy
        # never runs is dropped, and the lookup history (bounded by lookup_history_tokens, each request keyed by
        # its salt) and calibrator are the engine's, not the target's shared ones.
        builder = RoundBuilder(target, drafter, policy, policy_kwargs=policy_kwargs, lookup=lookup,
                               max_deferred_rounds=self.max_deferred_steps)
        if builder.uses_lookup:
            builder.history = LookupHistory(max_tokens=lookup_history_tokens)
        self.policy = builder.policy
        self.draft_width, self.lookup_width = builder.max_drafts, builder.max_lookup
        self.max_proposal = builder.max_proposal  # drafts one row may verify in a round
        self._raise_if_unservable_drafter()
        if drafter is not None and drafter._bound_target[:1] != [target]:
            drafter.bind_target(target)
        self.device = next(target.parameters()).device
        max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None) or max_batch_tokens
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_running_requests = int(max_running_requests)
        self.max_request_tokens = int(max_request_tokens if max_request_tokens is not None else
                                      min(max_positions, max_batch_tokens - self.max_proposal - 1))
        self.max_positions = int(max_positions)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.max_hole_fraction = float(max_hole_fraction)
        self.log_interval_s = float(log_interval_s)
        self._raise_if_invalid_limits()
        self.default_eos_ids = target_stop_token_ids(target)
        unapplied = unapplied_generation_settings(target)
        if unapplied:
            logger.warning("DSparkEngine does not apply these settings of target.generation_config, which plain "
                           "target.generate does: %s; its tokens (greedy included) may differ from plain generate's. "
                           "target.generate(..., assistant_model=drafter) applies its logits processors and stop "
                           "rules.",
                           ", ".join(f"{name}={value!r}" for name, value in unapplied.items()))
        self.cpu_linears = skinny_applies(target) and (
            skinny_pays(target) if cpu_linears is None else bool(cpu_linears))
        self.sps_cache_dir = sps_cache_dir
        self._cost = EngineStepCost(sps, target=target, drafter=builder.round_drafter,
                                    max_rows=self.max_running_requests, max_width=1 + max(self.max_proposal, 1),
                                    cache_dir=sps_cache_dir, kernels=self._linears,
                                    on_measured=self._observe_step_cost_measured)
        # Only a cost the engine measured itself is corrected by wall time: a user's table is their cost model (and
        # in tests a fixed one, which keeps scheduling decisions independent of the machine's load).
        self._round, self._lookup = builder.build(lambda: self.step_cost, observe_time=self._cost.is_measured)
        keeps_prefixes = prefix_cache and holds_croppable_context(self._round.drafter)
        self._prefixes = (RequestPrefixes(target, self._round.drafter, prefix_cache_bytes) if keeps_prefixes
                          else None)
        self._batch = RunningBatch(target.config, self.device)
        self._request_ids: set[str] = set()  # ids of requests not yet finished (duplicates are refused)
        self._incoming: deque[Request] = deque()
        self._incoming_lock = threading.Lock()
        self._quarantine = DecodeQuarantine()
        self.engine_metrics = EngineMetrics(max(builder.block_size, 1))
        self._admission = Admission(target, self._round.drafter, max_running_requests=self.max_running_requests,
                                    max_batch_tokens=self.max_batch_tokens,
                                    max_prefill_tokens=self.max_prefill_tokens, max_proposal=self.max_proposal,
                                    quarantine=self._quarantine, prefixes=self._prefixes,
                                    metrics=self.engine_metrics, on_finished=self._on_finished)
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._last_log = time.perf_counter()

    def _raise_if_unservable_drafter(self) -> None:
        drafter = self.drafter
        if drafter is None and self.policy.max_drafts(1) and not self.lookup_width:
            raise ValueError(f"verify policy {self.policy.name or type(self.policy).__name__!r} needs a drafter: "
                             "pass drafter=DSparkDraftModel..., use policy='none' for plain continuous batching, or "
                             "policy='scheduled' with lookup=True for lookup proposals only.")
        if drafter is not None and not architecture_of(drafter.config).servable:
            raise ValueError(f"DSparkEngine cannot serve a {drafter.config.drafter_architecture!r} drafter; run it "
                             "through target.generate(..., assistant_model=drafter) instead.")

    def _raise_if_invalid_limits(self) -> None:
        for name in ("max_batch_tokens", "max_running_requests", "max_request_tokens", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"DSparkEngine: {name} must be >= 1, got {getattr(self, name)}")
        if self.max_request_tokens + self.max_proposal + 1 > self.max_batch_tokens:
            raise ValueError(f"DSparkEngine: max_request_tokens={self.max_request_tokens} plus the verify overshoot "
                             f"({self.max_proposal + 1}) exceeds max_batch_tokens={self.max_batch_tokens}; raise "
                             "max_batch_tokens or lower max_request_tokens.")

    # -- the step cost ---------------------------------------------------------------------------------------
    @property
    def step_cost(self) -> StepCostProfile:
        """Seconds of one decode step (drafter pass + padded verify); measured (or loaded from the disk cache)
        on first access unless the engine was given a profile or an SPS table."""
        return self._cost.profile

    @property
    def sps(self) -> SPSProfile:
        """SPS(B): the table the engine was given, else the measured step cost read as SPS(B)."""
        return self._cost.sps

    def _observe_step_cost_measured(self, seconds: float) -> None:
        self.engine_metrics.step_cost_seconds += seconds

    def profile_sps(self) -> StepCostProfile:
        """Profile now (e.g. before serving) instead of at the first scheduled step."""
        return self.step_cost

    # -- submission (any thread) -------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, max_new_tokens: int = 64, *, do_sample: bool = False, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               eos_token_id: int | Sequence[int] | None = None, request_id: str | None = None,
               cache_salt: str | None = None, isolate: bool = False,
               params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request (token ids, text, or chat messages) and return its handle; thread-safe.

        ``params`` (a SamplingParams) replaces the setting keywords; giving one of them beside it is refused.
        Raises RequestRejectedError for a malformed request (ids that are not ints in the target's vocabulary, a
        2-D prompt, non-integer limits, a request_id already in use, a setting beside ``params``) and for one that
        could never fit the engine's limits: a bad request is refused here, never inside a step shared with others."""
        try:
            params = resolve_sampling_params(params, dict(
                max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                seed=seed, eos_token_id=eos_token_id, cache_salt=cache_salt, isolate=isolate))
            ids = encode_prompt(prompt, self.tokenizer, self.vocab_size)
            eos = stop_token_ids(params.eos_token_id, self.default_eos_ids, self.vocab_size)
            # NOTE: no separate max_batch_tokens check: __init__ ensures max_request_tokens + γ + 1 fits it.
            raise_if_never_fits(ids, params, self.max_request_tokens, self.max_positions)
        except RequestRejectedError:
            self.engine_metrics.rejected_requests += 1
            raise
        except ValueError as err:  # SamplingParams' range checks: the same refusal, one exception type
            self.engine_metrics.rejected_requests += 1
            raise RequestRejectedError(f"request rejected: {err}") from None
        request = Request(ids, params, eos, request_id=request_id, device=self.device)
        with self._incoming_lock:
            while request_id is None and request.request_id in self._request_ids:  # a caller's id took the name
                request.request_id = new_request_id()
            if request.request_id in self._request_ids:
                self.engine_metrics.rejected_requests += 1
                raise RequestRejectedError(f"request_id {request.request_id!r} is already in use by an unfinished "
                                           "request; give each request its own id")
            self._request_ids.add(request.request_id)
            self._incoming.append(request)
        self._wake.set()
        return RequestHandle(request, cancel=functools.partial(self._cancel, request), step=lambda: self.step(),
                             is_running=lambda: self.is_running, tokenizer=self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.target.get_input_embeddings().weight.shape[0]

    def _cancel(self, request: Request) -> None:
        request.cancel_requested = True
        self._wake.set()

    # -- the loop ----------------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def has_work(self) -> bool:
        return bool(self._incoming or self._admission.has_work or self._batch.live_requests)

    def start(self) -> DSparkEngine:
        """Run the engine loop in a background thread (idempotent)."""
        if not self.is_running:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the loop thread; with ``drain`` first let every queued request finish. Requests still unfinished
        afterwards end with finish reason "aborted"."""
        if drain:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.has_work() and (deadline is None or time.monotonic() < deadline):
                if not self.is_running:
                    self.step()
                else:
                    time.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._step_lock:
            self._take_incoming()
            for request in [*self._admission.take_all(), *self._batch.live_requests]:
                request.finish(FinishReason.ABORTED)
                self._on_finished(request)
            self._batch.keep([])

    def __enter__(self) -> DSparkEngine:  # noqa: PYI034 (Self needs Python 3.11)
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(drain=exc[0] is None)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                worked = self.step()
            except Exception:  # the step already failed its requests; the loop must survive
                logger.exception("DSparkEngine step failed; its requests were ended with an error")
                worked = True
            if not worked:
                self._wake.wait(0.05)
                self._wake.clear()

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int = 64, **params) -> list[RequestOutput]:
        """Blocking convenience: submit every prompt, wait for all (driving the loop if no thread runs). A prompt that
        is refused cancels the ones submitted before it (nobody holds their handles) and raises."""
        handles = []
        try:
            for prompt in prompts:
                handles.append(self.submit(prompt, max_new_tokens, **params))
        except Exception:
            for handle in handles:
                handle.cancel()
            raise
        return [handle.result() for handle in handles]

    def step(self) -> bool:
        """One engine iteration (admit, prefill, draft, verify, commit, retire); False when idle."""
        with self._step_lock:
            self._take_incoming()
            self._retire()
            if not (self._admission.has_work or len(self._batch)):
                return False
            start, setup_before = time.perf_counter(), self.engine_metrics.step_cost_seconds
            try:
                with torch.no_grad(), self._linears(), self._feature_tap() as tap:
                    joining = self._prefill_admitted(tap)
                    if joining and self.draft_width:
                        self._batch.flush_context(self.drafter)
                    # into vacant rows first; rows left vacant are dropped
                    self.engine_metrics.joined_in_place += self._batch.join(joining)
                    if len(self._batch):
                        self._decode_isolating_faults(tap)
                self._retire()
            except Exception as err:
                self._fail_running(err)
                raise
            finally:
                self.engine_metrics.steps += 1
                # a step cost measured in this step (the first scheduled one) is setup, not serving
                setup = self.engine_metrics.step_cost_seconds - setup_before
                self.engine_metrics.busy_seconds += time.perf_counter() - start - setup
            self._maybe_log()
            return True

    def _linears(self):
        """The kernel every forward of a step runs with (``cpu_kernels``), patched for the step only: the caller's
        own use of the target between steps keeps its stock linears."""
        return loop_linears(self.cpu_linears, self.target, self.drafter)

    def _feature_tap(self):
        if not self.draft_width:
            return contextlib.nullcontext(None)
        return TargetFeatureTap(self.target, self.drafter.config.target_layer_ids)

    def _take_incoming(self) -> None:
        with self._incoming_lock:
            self._admission.add(self._incoming)
            self._incoming.clear()

    def _prefill_admitted(self, tap) -> list[JoiningRows]:
        """Admit waiting requests, advance the prefills; the requests whose prompts are done, ready to join (each
        indexed for lookup from its first token on; a request resuming after a failed step still is)."""
        self._admission.admit(self._batch.live_requests)
        joining = self._admission.prefill(tap)
        if self._lookup is not None:
            for request in (r for group in joining for r in group.requests if not r.lookup_row):
                key = (None if request.params.isolate else
                       LookupHistoryKey.for_model(self.target, self.tokenizer, salt_scope(request.params.cache_salt)))
                self._lookup.start_row(request.request_id, request.prompt_ids + request.tokens, history_key=key)
                request.lookup_row = True
        return joining

    def _retire(self) -> None:
        """End cancelled requests wherever they are; vacate finished rows of the batch (a request joining next
        takes the row in place, ``RunningBatch.join``; rows left vacant are dropped before the next decode)."""
        for request in self._admission.take_cancelled():
            request.finish(FinishReason.CANCELLED)
            self._on_finished(request)
        leaving = []
        for row, request in enumerate(self._batch.requests):
            if row in self._batch.vacant:
                continue
            if request.cancel_requested and not request.is_finished:
                request.finish(FinishReason.CANCELLED)
            if request.is_finished:
                self._keep_prefix(row, request)
                self._on_finished(request)
                leaving.append(row)
        self._batch.vacate(leaving)

    def _keep_prefix(self, row: int, request: Request) -> None:
        """Leave a finished request's caches for its salt's next request. Only an optimisation: a failure here (out
        of memory cutting the row out) keeps nothing and must not fail the step's requests, the finished one
        included."""
        if self._prefixes is None:
            return
        try:
            self._prefixes.keep(self._batch, row, request)
        except Exception:
            logger.exception("keeping the caches of request %s failed; nothing kept for its next request",
                             request.request_id)

    def _on_finished(self, request: Request) -> None:
        if self._lookup is not None and getattr(request, "lookup_row", False):
            # a completed request's text becomes lookup history for its salt (never a cancelled or failed one)
            keep = request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            self._lookup.end_row(request.request_id, keep_in_history=keep)
            request.lookup_row = False
        with self._incoming_lock:
            self._request_ids.discard(request.request_id)
        self.engine_metrics.observe_finished(request.finish_reason.value, request.metrics())

    def _fail_running(self, err: BaseException) -> None:
        """A failed step ends the requests it touched (prefilling and running); waiting ones stay queued."""
        for request in [*self._admission.take_prefilling(), *self._batch.live_requests]:
            request.finish(FinishReason.ERROR, error=err)
            self._on_finished(request)
        self._batch.keep([])

    # -- one speculative round for the whole batch (the round generate runs too) -------------------------------
    def _decode_isolating_faults(self, tap) -> None:
        """A decode step; if it fails, the batch (its cache may be half-written) is dropped, the request the
        failure is traced to fails, and the others resume from their committed tokens (see DecodeQuarantine)."""
        try:
            self._decode(tap)
        except Exception as err:
            rows = list(self._batch.requests)
            culprit, resume = self._quarantine.after_failure(rows)
            self._batch.keep([])
            self.engine_metrics.isolated_step_failures += 1
            if culprit is not None:
                logger.error("decode step failed (%s: %s); request %s fails, %d resume from their committed tokens",
                             type(err).__name__, err, culprit.request_id, len(resume))
                culprit.finish(FinishReason.ERROR, error=err)
                self._on_finished(culprit)
            else:
                logger.error("decode step failed (%s: %s); its %d requests resume one at a time to find the cause",
                             type(err).__name__, err, len(resume))
            self._admission.resume_first(resume)
            return
        self._quarantine.after_success(self._batch.requests)

    def _decode(self, tap) -> None:
        batch, metrics = self._batch, self.engine_metrics
        # the batch may grow as wide as its share of max_batch_tokens (its memory bound) before it must compact;
        # at least its widest reservation, which admission guarantees a compacted batch fits
        slot_budget = max(max(self._admission.reservation(r) for r in batch.requests),
                          self.max_batch_tokens // len(batch))
        if batch.compact_if_needed(1 + self.max_proposal, slot_budget, self.max_hole_fraction):
            metrics.compactions += 1
        processor = BatchLogitsProcessor(batch.requests)
        modes = [r.params.do_sample for r in batch.requests]
        do_sample = modes[0] if len(set(modes)) == 1 else modes
        result = self._round.run(batch, processor, [r.num_remaining for r in batch.requests], do_sample=do_sample,
                                 generator=processor.generators, tap=tap, step=metrics.decode_steps,
                                 row_ids=[r.request_id for r in batch.requests])
        if self.draft_width and result.block is None:
            metrics.skipped_draft_steps += 1  # drafting could not pay at this load: a plain step
        metrics.draft_seconds += result.draft_seconds
        metrics.verify_seconds += result.verify_seconds
        self._commit(result)

    def _commit(self, result) -> None:
        """Stream each request's accepted + recovered/bonus tokens (stopping at EOS / max_new_tokens)."""
        now = time.perf_counter()
        committed = []
        for request, tokens in zip(self._batch.requests, result.tokens):
            committed.append(request.commit(tokens, now))
            request.num_rounds += 1
            if self._lookup is not None:
                self._lookup.commit(request.request_id, tokens[: committed[-1]])
        metrics = self.engine_metrics
        metrics.generated_tokens += sum(committed)
        metrics.stats.observe_round(result.num_drafts, result.num_accepted, committed, result.sources)
        metrics.observe_decode_step(len(committed), result.width, result.num_drafts, result.num_accepted,
                                    drafted=result.block is not None, committed=sum(committed),
                                    seconds=result.draft_seconds + result.verify_seconds)
        logger.debug("step %d: R=%d, verify tokens B=%d (width %d), accepted %d, committed %d",
                     metrics.decode_steps, len(committed), len(committed) + sum(result.num_drafts), result.width,
                     sum(result.num_accepted), sum(committed))

    # -- metrics -----------------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Engine counters and latency means (see ``EngineMetrics``), plus the current queue sizes."""
        out = self.engine_metrics.to_dict()
        out.update(policy=getattr(self.policy, "name", type(self.policy).__name__), draft_width=self.draft_width,
                   waiting=len(self._admission.waiting) + len(self._incoming),
                   prefilling=len(self._admission.prefilling),
                   running=len(self._batch.live_requests), cache_slots=self._batch.num_slots,
                   reserved_slots=self._admission.reserved_slots(self._batch.live_requests))
        return out

    def log_metrics(self) -> None:
        self.engine_metrics.log()

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        if now - self._last_log >= self.log_interval_s:
            self._last_log = now
            self.log_metrics()


__all__ = ["DSparkEngine"]
