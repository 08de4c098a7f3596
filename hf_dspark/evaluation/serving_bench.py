"""Serving benchmark (paper Figs. 7-8, ``hf-dspark serve-bench``): DSparkEngine throughput vs per-user speed under
closed-loop load.

For each concurrency C, every policy serves the same request stream with C requests always in flight (a finished
request is replaced at once): engine throughput (generated tok/s over the run), per-user tok/s (each request's
decoding speed after its first token, averaged), TTFT, mean verify budget (drafts verified per request per step),
τ and wasted verify tokens, and the time per kind of step. By default the policies of one concurrency level run in
lock-step, one engine step each in turn, every policy timed on its own clock (:class:`ClosedLoop`), so the drift of
a shared machine hits them alike; their order is rotated each round and each repeat.

Two streams: the benchmarks' first turns (``workload="prompts"``, independent requests) and C scripted
tool-calling agents (``workload="agents"``, :class:`AgentClosedLoop`), each request re-reading its agent's growing
conversation — the traffic the product is for, where lookup proposals are long.
"""

from __future__ import annotations

import logging
import random
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..speculation.shared_state import LONG_MATCH_TOKENS
from ..serving import DSparkEngine
from .agent_script import STEPS, TURNS, ScriptedAgent, render_ids
from .benchmarks import read_benchmark_prompts

BENCHMARKS = ("gsm8k", "humaneval", "mt-bench")
DEFAULT_POLICIES = "none,fixed1,fixed3,fixed7,threshold,scheduled"
logger = logging.getLogger(__name__)


@dataclass
class ServingBenchSettings:
    """The load to apply: requests per level = max(``min_requests``, ``requests_factor`` × C)."""

    levels: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)
    policies: Sequence[str] = tuple(DEFAULT_POLICIES.split(","))
    threshold: float = 0.5
    max_new_tokens: int = 128
    #: None: every request asks for ``max_new_tokens``; else request i asks for a number drawn uniformly from
    #: [min_new_tokens, max_new_tokens], seeded by i (the same stream for every policy and repeat)
    min_new_tokens: int | None = None
    requests_factor: float = 2.0
    min_requests: int = 8
    temperature: float = 0.0
    repeats: int = 1
    max_prefill_tokens: int = 2048
    cpu_linears: bool | None = None  # every engine's ``cpu_linears`` (None: skinny where it pays; False: stock)
    interleave: str = "steps"  # "steps": the policies of a level in lock-step (ClosedLoop); "runs": one by one
    #: "prompts": benchmark first turns (``ClosedLoop``); "agents": C scripted tool-calling agents
    #: (``AgentClosedLoop``), ``agent_turns`` user turns of 4 generations each
    workload: str = "prompts"
    agent_turns: int = 2


def parse_policy(label: str, threshold: float) -> tuple[str, dict, dict]:
    """(policy, policy kwargs, engine kwargs) for "none", "fixedN" (verify N drafts), "fixed" (all), "threshold",
    "scheduled" (lookup + drafter, the default), "scheduled-nolookup" (drafter only), "lookup-only" (no drafter),
    "scheduled-async"."""
    match = re.fullmatch(r"fixed(\d+)", label)
    if match:
        return "fixed", {"num_tokens": int(match.group(1))}, {}
    if label == "threshold":
        return "threshold", {"threshold": threshold}, {}
    if label == "scheduled-nolookup":
        return "scheduled", {}, {"lookup": False}
    if label == "lookup-only":
        return "scheduled", {}, {"lookup": True, "drafter": None}
    return label, {}, {}


def serving_prompts(tokenizer, eval_dir, per_benchmark: int, max_prompts: int | None,
                    max_prompt_tokens: int) -> list[tuple[str, list[int]]]:
    """First turns, chat-templated, interleaved across benchmarks (gsm8k, humaneval, mt-bench, gsm8k, ...)."""
    per_name = {}
    for name in BENCHMARKS:
        rows = []
        for prompt in read_benchmark_prompts(name, eval_dir):
            ids = render_ids(tokenizer, [{"role": "user", "content": prompt.first_turn}])
            if len(ids) <= max_prompt_tokens:
                rows.append((name, ids))
            if len(rows) == per_benchmark:
                break
        per_name[name] = rows
    mixed = [row for group in zip(*per_name.values()) for row in group]
    return mixed[:max_prompts] if max_prompts else mixed


class ClosedLoop:
    """One policy's closed loop (``concurrency`` requests in flight until ``num_requests`` were served), advanced
    one engine step at a time on its own clock: the seconds its own steps (and submissions) took.

    Why a clock of its own: this project's machine is shared, and its speed drifts by ±10-25 % over tens of seconds,
    so arms timed one after another differ by more than the policies do. Stepping every arm's loop in turn
    (:func:`run_interleaved`) lets each arm see the same drift, at the granularity of one step, and each arm's
    throughput, per-user speed and TTFT are read off its own clock.

    Besides the whole run (``throughput``, the drain at the end included), the record has
    ``full_load_throughput``: tokens committed per second of the clock until the first slot goes idle for want of
    requests. A finite closed loop ends with a drain whose length depends on how the last requests happen to be
    staggered (equal-length requests under plain decoding finish together; speculation staggers them), which a
    server under steady traffic never sees; the full-load window is that steady state."""

    def __init__(self, engine: DSparkEngine, prompts: list[tuple[str, list[int]]], concurrency: int,
                 num_requests: int, max_new_tokens: int, sampling: dict, min_new_tokens: int | None = None, *,
                 now: Callable[[], float] = time.perf_counter):
        self.engine, self.prompts, self.concurrency = engine, prompts, concurrency
        self.num_requests, self.max_new_tokens, self.sampling = num_requests, max_new_tokens, sampling
        self.min_new_tokens = min_new_tokens
        self.now = now  # the machine's clock the loop's own clock advances by (tests hand in a fake one)
        self.clock = 0.0
        self.submitted = 0
        self.inflight: list[tuple[int, object, float]] = []  # (index, handle, submitted at, on the clock)
        self.first_token: dict[int, float] = {}
        self.outputs: dict[int, object] = {}
        self.finished_at: dict[int, float] = {}
        self.full_load: tuple[float, int] | None = None  # (clock, tokens) when the drain began

    @property
    def done(self) -> bool:
        return self.submitted >= self.num_requests and not self.inflight

    def advance(self) -> None:
        """Top the loop up to ``concurrency`` requests, run one engine step, collect what finished."""
        start = self.now()
        self._top_up(lambda: self.clock + self.now() - start)
        if self.full_load is None and len(self.inflight) < self.concurrency:  # a slot idles: nothing left to send
            tokens = sum(len(out.token_ids) for out in self.outputs.values())
            self.full_load = (self.clock, tokens + sum(len(h.token_ids) for _, h, _ in self.inflight))
        self.engine.step()
        self.clock += self.now() - start
        still = []
        for index, handle, submitted_at in self.inflight:
            if index not in self.first_token and handle.token_ids:
                self.first_token[index] = self.clock - submitted_at
            if handle.done():
                self.outputs[index] = handle.result()
                self.finished_at[index] = self.clock - submitted_at
                self._finished(index, self.outputs[index])
            else:
                still.append((index, handle, submitted_at))
        self.inflight = still

    def _top_up(self, now) -> None:
        """Submit requests until ``concurrency`` are in flight or the stream is exhausted (``now()``: the clock)."""
        while len(self.inflight) < self.concurrency and self.submitted < self.num_requests:
            _, ids = self.prompts[self.submitted % len(self.prompts)]
            handle = self.engine.submit(ids, request_length(self.submitted, self.min_new_tokens,
                                                            self.max_new_tokens), **self.sampling)
            self.inflight.append((self.submitted, handle, now()))
            self.submitted += 1

    def _finished(self, index: int, output) -> None:
        """Request ``index`` finished (a stream of independent requests has nothing to do)."""

    def record(self) -> dict:
        """The run's numbers (see the module docstring); ``outputs`` maps request index -> token ids."""
        m = self.engine.metrics()
        tokens = sum(len(out.token_ids) for out in self.outputs.values())
        full_seconds, full_tokens = self.full_load if self.full_load is not None else (self.clock, tokens)
        per_user, ttft = [], []
        for index, out in self.outputs.items():
            n, first, last = len(out.token_ids), self.first_token.get(index), self.finished_at[index]
            if first is not None:
                ttft.append(first)
                if n > 1 and last > first:
                    per_user.append((n - 1) / (last - first))
        return {
            "concurrency": self.concurrency, "num_requests": len(self.outputs), "generated_tokens": tokens,
            "wall_s": self.clock, "throughput": tokens / self.clock if self.clock else 0.0,
            "full_load_throughput": full_tokens / full_seconds if full_seconds else None,
            "full_load_s": full_seconds, "full_load_tokens": full_tokens,
            "per_user_tps": sum(per_user) / len(per_user) if per_user else None,
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None, "mean_verify_budget": m["mean_verify_budget"],
            "mean_verify_tokens": m["mean_verify_tokens"], "mean_batch_size": m["mean_batch_size"], "tau": m["tau"],
            "acceptance_rate": m["acceptance_rate"], "wasted_verify_tokens": m["wasted_verify_tokens"],
            "padding_tokens": m["padding_tokens"], "draft_s": m["draft_s"], "verify_s": m["verify_s"],
            "prefill_s": m["prefill_s"], "compactions": m["compactions"], "decode_steps": m["decode_steps"],
            "skipped_draft_steps": m["skipped_draft_steps"], "step_kinds": m["step_kinds"],
            "outputs": {index: out.token_ids for index, out in sorted(self.outputs.items())},
        }


class AgentClosedLoop(ClosedLoop):
    """``concurrency`` scripted tool-calling agents (:class:`~hf_dspark.evaluation.agent_script.ScriptedAgent`),
    each sending its next generation as soon as its last one is answered: the engine serves the product's own use
    case, every request re-reading its agent's growing conversation. Agent ``a`` starts at scripted turn ``a`` (the
    agents ask different things) and has a cache salt of its own (its earlier replies are lookup history and its
    caches are kept for its next request, never another agent's). Request ``a × G + k`` is agent ``a``'s ``k``-th
    generation, whatever the order they finish in, so greedy outputs compare across policies by index."""

    def __init__(self, engine: DSparkEngine, tokenizer, concurrency: int, turns_per_agent: int, sampling: dict):
        self.agents = [ScriptedAgent(turns_per_agent, first_turn=a) for a in range(concurrency)]
        generations = self.agents[0].num_generations
        super().__init__(engine, [], concurrency, concurrency * generations, max(STEPS.values()), sampling)
        self.tokenizer, self.generations = tokenizer, generations
        self._idle = list(range(concurrency))  # agents whose last generation was answered (all, at the start)

    def _top_up(self, now) -> None:
        for agent_index in self._idle:
            agent = self.agents[agent_index]
            if agent.done:
                continue
            index = agent_index * self.generations + agent.generation
            messages, max_new_tokens = agent.next_request()
            handle = self.engine.submit(render_ids(self.tokenizer, messages), max_new_tokens,
                                        cache_salt=f"agent-{agent_index}", **self.sampling)
            self.inflight.append((index, handle, now()))
            self.submitted += 1
        self._idle = []

    def _finished(self, index: int, output) -> None:
        agent_index = index // self.generations
        self.agents[agent_index].reply(self.tokenizer.decode(output.token_ids, skip_special_tokens=True))
        self._idle.append(agent_index)


def agent_slots(tokenizer, turns_per_agent: int, widest: int) -> int:
    """Cache slots an agent's longest request may need: the longest script (over every starting turn) with every
    reply at its token budget (replies of that many tokens, measured as text of as many words, may re-tokenise
    longer: a margin of 25 %)."""
    longest = 0
    for first_turn in range(len(TURNS)):
        agent = ScriptedAgent(turns_per_agent, first_turn)
        while not agent.done:
            _, max_new_tokens = agent.next_request()
            agent.reply(" ".join(["word"] * max_new_tokens))
        longest = max(longest, len(render_ids(tokenizer, agent.messages)))
    return int(1.25 * longest) + max(STEPS.values()) + widest + 1


def request_length(index: int, min_new_tokens: int | None, max_new_tokens: int) -> int:
    """The new tokens request ``index`` of the stream asks for: ``max_new_tokens``, or a draw from [min, max] seeded
    by the index. Why a spread: requests of one length under plain decoding finish in the same step and the next
    ones are prefilled together, a lock-step that real traffic (answers of every length) never has and that
    speculation, which staggers them, cannot keep; the spread serves every policy the same staggered stream."""
    if min_new_tokens is None or min_new_tokens >= max_new_tokens:
        return max_new_tokens
    return random.Random(index).randint(max(1, min_new_tokens), max_new_tokens)


def run_level(engine: DSparkEngine, prompts: list[tuple[str, list[int]]], concurrency: int, num_requests: int,
              max_new_tokens: int, sampling: dict, min_new_tokens: int | None = None) -> dict:
    """One policy's closed loop run alone to the end (:class:`ClosedLoop`); its record."""
    loop = ClosedLoop(engine, prompts, concurrency, num_requests, max_new_tokens, sampling, min_new_tokens)
    while not loop.done:
        loop.advance()
    return loop.record()


def run_interleaved(loops: Sequence[ClosedLoop]) -> list[dict]:
    """Advance every loop by one step in turn (the first to step rotating each round) until all are done; their
    records, in order. Each loop times only its own steps, so a slow stretch of the machine costs every arm alike."""
    loops = list(loops)
    turn = 0
    while not all(loop.done for loop in loops):
        shift = turn % len(loops)
        for loop in loops[shift:] + loops[:shift]:
            if not loop.done:
                loop.advance()
        turn += 1
    return [loop.record() for loop in loops]


def run_serving_bench(target, drafter, tokenizer, prompts: list[tuple[str, list[int]]], sps,
                      settings: ServingBenchSettings, sps_cache_dir: str | None = None) -> list[dict]:
    """Every (concurrency, repeat, policy) cell on the same request stream; one record per cell. Greedy runs also
    record how often the batched outputs equal the first policy's (``greedy_agreement``). ``sps`` None: every
    engine measures its own step cost (disk cache ``sps_cache_dir``) and corrects it by wall time, as by default;
    a profile or table: every engine uses it as it is. ``settings.interleave``: "steps" runs the policies of one
    (concurrency, repeat) in lock-step (:func:`run_interleaved`), "runs" one after another."""
    if settings.interleave not in ("steps", "runs"):
        raise ValueError(f"serve-bench: interleave must be 'steps' or 'runs', got {settings.interleave!r}")
    if settings.workload not in ("prompts", "agents"):
        raise ValueError(f"serve-bench: workload must be 'prompts' or 'agents', got {settings.workload!r}")
    agents = settings.workload == "agents"
    widest = max(drafter.config.block_size, LONG_MATCH_TOKENS)  # a lookup proposal may exceed the block
    slots = (agent_slots(tokenizer, settings.agent_turns, widest) if agents else
             max(len(ids) for _, ids in prompts) + settings.max_new_tokens + widest + 1)
    sampling = {"do_sample": True, "temperature": settings.temperature} if settings.temperature > 0 else {}
    policies = list(settings.policies)
    results = []
    for concurrency in settings.levels:
        num_requests = max(settings.min_requests, round(settings.requests_factor * concurrency))
        reference = None
        for repeat in range(settings.repeats):
            shift = repeat % len(policies)  # no policy always runs first (or right after a warm cache)
            labels = policies[shift:] + policies[:shift]
            loops = []
            for label in labels:
                name, kwargs, engine_kwargs = parse_policy(label, settings.threshold)
                engine_drafter = engine_kwargs.pop("drafter", drafter if name != "none" else None)
                engine = DSparkEngine(target, engine_drafter, name, policy_kwargs=kwargs, sps=sps,
                                      sps_cache_dir=sps_cache_dir, max_running_requests=concurrency,
                                      max_batch_tokens=concurrency * slots,
                                      max_prefill_tokens=settings.max_prefill_tokens, tokenizer=tokenizer,
                                      cpu_linears=settings.cpu_linears, **engine_kwargs)
                if engine.policy.needs_step_cost:  # start-up (profile or its spot check), not part of the stream
                    _ = engine.step_cost
                loop = (AgentClosedLoop(engine, tokenizer, concurrency, settings.agent_turns, sampling) if agents
                        else ClosedLoop(engine, prompts, concurrency, num_requests, settings.max_new_tokens, sampling,
                                        settings.min_new_tokens))
                if settings.interleave == "runs":
                    while not loop.done:
                        loop.advance()
                loops.append(loop)
            records = run_interleaved(loops) if settings.interleave == "steps" else [l.record() for l in loops]
            for label, record in zip(labels, records):
                outputs = record.pop("outputs")
                if reference is None:
                    reference = outputs
                elif not sampling:
                    record["greedy_agreement"] = sum(outputs[i] == reference[i] for i in reference) / len(reference)
                record["policy"], record["repeat"] = label, repeat
                record["interleave"] = settings.interleave
                results.append(record)
                logger.info("C=%3d %16s #%d: %7.1f tok/s, per-user %6.1f tok/s, verify budget %.2f, tau %.2f, "
                            "TTFT %.2fs", concurrency, label, repeat, record["throughput"],
                            record["per_user_tps"] or 0, record["mean_verify_budget"], record["tau"],
                            record["mean_ttft_s"] or 0)
    return results


def median_over_repeats(results: list[dict]) -> list[dict]:
    """One record per (concurrency, policy): the median of every numeric field over the repeats (the machine is
    shared; a single run per cell is too noisy to rank policies that differ by a few percent)."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for record in results:
        groups.setdefault((record["concurrency"], record["policy"]), []).append(record)
    summary = []
    for (concurrency, policy), records in groups.items():
        merged = {"concurrency": concurrency, "policy": policy, "repeats": len(records)}
        for key, value in records[0].items():
            values = [r.get(key) for r in records]
            if key not in merged and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                merged[key] = statistics.median(values)
        kinds: dict[str, dict] = {}  # summed over the repeats
        for record in records:
            for kind, entry in record.get("step_kinds", {}).items():
                total = kinds.setdefault(kind, dict.fromkeys(entry, 0))
                for key, value in entry.items():
                    total[key] += value
        merged["step_kinds"] = kinds
        merged["throughput_runs"] = [r["throughput"] for r in records]
        merged["full_load_throughput_runs"] = [r.get("full_load_throughput") for r in records]
        summary.append(merged)
    return summary


def summary_table(summary: list[dict], policies: Sequence[str], levels: Sequence[int]) -> str:
    """Median throughput (per-user tok/s) per concurrency and policy, as ``hf-dspark serve-bench`` prints it."""
    by_cell = {(r["concurrency"], r["policy"]): r for r in summary}
    lines = ["median throughput tok/s (per-user tok/s) [at full load, before the drain] over repeats",
             "C    | " + " | ".join(f"{p:>24s}" for p in policies)]
    for concurrency in levels:
        cells = []
        for policy in policies:
            r = by_cell.get((concurrency, policy))
            cells.append(f"{r['throughput']:7.1f} ({r['per_user_tps'] or 0:5.1f}) [{r.get('full_load_throughput') or 0:5.1f}]"
                         if r else " " * 24)
        lines.append(f"{concurrency:<4d} | " + " | ".join(f"{c:>24s}" for c in cells))
    return "\n".join(lines)


def step_kind_table(summary: list[dict], policies: Sequence[str], levels: Sequence[int]) -> str:
    """Per (concurrency, policy) and kind of decode step: steps, rows, tokens per step, ms per step and tok/s, summed
    over the repeats — where each policy's decoding time went (the full load and the drain together)."""
    by_cell = {(r["concurrency"], r["policy"]): r for r in summary}
    lines = ["decode steps by kind, summed over repeats: steps, mean rows, tokens/step, ms/step, tok/s"]
    for concurrency in levels:
        for policy in policies:
            record = by_cell.get((concurrency, policy))
            for kind, e in sorted((record or {}).get("step_kinds", {}).items()):
                if e["steps"]:
                    lines.append(f"C={concurrency:<3d} {policy:>20s} {kind:>26s}: {e['steps']:5d} steps, "
                                 f"{e['rows'] / e['steps']:5.1f} rows, {e['tokens'] / e['steps']:5.2f} tok/step, "
                                 f"{1000 * e['seconds'] / e['steps']:6.1f} ms, "
                                 f"{e['tokens'] / e['seconds'] if e['seconds'] else 0:6.1f} tok/s")
    return "\n".join(lines)
