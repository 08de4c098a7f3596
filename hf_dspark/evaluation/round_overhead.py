"""Host overhead of one speculative round: hf-dspark vs transformers' own DFlash and assisted-decoding loops.

The targets are tiny random Llama / Qwen3 models (``smollm2``: the SmolLM2-135M architecture, random weights),
so a forward costs almost nothing and what is measured is the Python and bookkeeping around it: the cost a GPU
user pays on top of the model (issue #15). Acceptance is fixed by an *oracle*: the plain greedy continuation of
every prompt is computed once, and each round the drafter's proposal is replaced by ``continuation[pos:pos+γ]``
with the tail from slot k on corrupted, so exactly k of the γ = 7 drafts are accepted (``all``: k = 7,
``4of7``: k = 4, ``none``: k = 0). The real drafter still runs first (its cost is part of the round); the oracle
itself is a gather, no model call and no host sync. Every run's output is checked against the continuation
(greedy identity: ``status`` says "output differs" otherwise), so a broken oracle cannot go unnoticed.

Implementations (``--impls``):
    dspark    ``target.generate(..., assistant_model=dspark_drafter, dspark_num_tokens=7)``
    engine    ``DSparkEngine(target, drafter, policy="fixed").generate(...)`` (plain variant only)
    dflash    ``target.generate(..., assistant_model=MuseGlimmerAssistantModel, speculation_type="dflash")``
    dspark-dflash  hf-dspark's ``generate`` with *that same* DFlash assistant, loaded by
              ``DSparkDraftModel.from_pretrained`` (transformers-dflash dialect; Qwen3 targets only): one drafter,
              two loops, so the difference is the loop alone
    assisted  ``target.generate(..., assistant_model=<1-layer model>)`` with a constant 7-token schedule
    plain     plain greedy ``generate`` (opt-in): rounds of one token, the per-token baseline
transformers refuses batch > 1 for its two loops, reported as n/a.

Variants (``--variants``): ``plain`` greedy, ``min_new_tokens`` (= N: a logits processor that reads the length),
``repetition_penalty`` (1.3: a processor that reads every id of the prefix) and ``threshold`` (hf-dspark only:
``dspark_confidence_threshold=1e-9``, so every slot still passes but the drafter's early-exit path runs).

Reported per configuration (medians over ``--repeats`` runs, interleaved across implementations in one process):
    ms/round     wall time from the end of the last prefill forward to the return of ``generate``, divided by
                 the rounds (target forwards over ≤ γ + 1 tokens per row); ``cpu ms``: the same in this
                 process's CPU time (on a shared CPU machine the steadier of the two)
    syncs/round  device→host reads in that window, from one extra counting run (what counts on CPU and on CUDA:
                 ``round_probes.SyncCounter``), split into ``loop`` (outside the target's forward) and ``fwd``
                 (inside it); ``h2d``: host→device builds from Python data (a blocking copy on CUDA)
    ops/round    aten ops dispatched per round in the counting run, split into ``loop ops`` (outside the target's
                 forward and the drafter) and ``draft ops``; the rest are the target forward's
    fwd/draft    ms per round inside the target's forward and inside the drafter (hf-dspark: ``draft_block`` +
                 ``extend_context``; transformers: ``get_candidates``), in CPU time on a CPU and device time
                 (CUDA events) on a GPU; ``host`` = cpu ms (CPU) or ms/round (GPU) − fwd − draft: the estimate
                 of host time per round excluding both forwards

    python scripts/bench_overhead.py --out runs/bench_overhead               # full matrix (long)
    python scripts/bench_overhead.py --quick --out /tmp/bo                    # CI smoke, seconds
    python scripts/bench_overhead.py --models llama --tokens 256 2048 --batch 1 8 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import logging
import platform
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ..version import __version__
from ..embedded import DEFAULT_DRAFTER_DIR
from ..modeling import DSparkDraftModel
from ..serving import DSparkEngine
from .round_probes import (NUM_DRAFTS, PROMPT_LEN, Probe, RunMeasurement, SyncCounter, dspark_oracle,
                           transformers_oracle)

logger = logging.getLogger(__name__)

EOS_ID, PAD_ID, BOS_ID = 2, 0, 1
REPETITION_PENALTY = 1.3
ACCEPTED = {"all": NUM_DRAFTS, "4of7": 4, "none": 0}
VARIANTS = ("plain", "min_new_tokens", "repetition_penalty", "threshold")
IMPLS = ("plain", "dspark", "engine", "dflash", "dspark-dflash", "assisted")
DEFAULT_IMPLS = IMPLS[1:]  # plain greedy generate (rounds of one token) is the opt-in per-token baseline
FAMILIES = ("llama", "qwen3", "smollm2")
NOT_APPLICABLE = "n/a"


# ---------------------------------------------------------------------------------------------------------
# Models: a target, its DSpark drafter, a DFlash assistant and a classic assistant
# ---------------------------------------------------------------------------------------------------------
def shipped_drafter_config() -> dict:
    """config.json of the drafter shipped for SmolLM2-135M-Instruct (read as data: only its shapes are used)."""
    return json.loads((DEFAULT_DRAFTER_DIR / "config.json").read_text())


def build_target(family: str, vocab_size: int, seed: int = 0, num_layers: int | None = None) -> torch.nn.Module:
    """A random target whose EOS never wins greedy decoding: its LM-head row is zero, so its logit is 0 while the
    max over the other random logits is positive (all but surely). Runs then always last exactly N tokens, yet
    the EOS id exists, so ``min_new_tokens`` installs its processor.

    ``llama`` / ``qwen3``: 2 layers of width 64 (model compute ≈ 0). ``smollm2``: the SmolLM2-135M architecture
    (30 layers, width 576, vocabulary 49,152) with random weights, for rounds of a real model's size on a GPU.
    initializer_range 0.2 gives wide logit margins, so no near-tie can make the check against the greedy
    continuation depend on kernel shapes."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers or 2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=BOS_ID,
                  eos_token_id=EOS_ID, pad_token_id=PAD_ID, initializer_range=0.2)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, tie_word_embeddings=False, **common))
    elif family == "smollm2":
        shape = {k: v for k, v in shipped_drafter_config()["target_config"].items() if not k.startswith("_")}
        shape.update(initializer_range=0.2, eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID)
        if num_layers is not None:
            shape["num_hidden_layers"] = num_layers
        model = LlamaForCausalLM(LlamaConfig(**shape))
    else:
        raise ValueError(f"unknown --models entry {family!r}; use one of {FAMILIES}")
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS_ID] = 0.0
    return model.eval()


def build_dspark_drafter(family: str, target) -> DSparkDraftModel:
    """A random DSpark drafter: one layer over target layer 0 for the tiny targets; for ``smollm2`` the shipped
    drafter's shape (layers, Markov rank, top-k, 8,192-token draft vocabulary, the same target layers)."""
    torch.manual_seed(3)
    if family != "smollm2":
        return DSparkDraftModel.from_target(target, num_layers=1, block_size=NUM_DRAFTS, markov_rank=16,
                                            target_layer_ids=[0]).eval()
    cfg = shipped_drafter_config()
    return DSparkDraftModel.from_target(
        target, num_layers=cfg["num_hidden_layers"], block_size=NUM_DRAFTS, head=cfg["sequential_head"],
        markov_rank=cfg["markov_rank"], target_layer_ids=cfg["target_layer_ids"],
        sequential_top_k=cfg["sequential_top_k"], draft_vocab=list(range(cfg["draft_vocab_size"]))).eval()


def build_dflash_assistant(target, target_layer_ids: list[int]):
    """transformers' own DFlash drafter (one layer, the target's width, the same target layers as the DSpark
    drafter), block_size γ + 1: it proposes block_size − 1 = γ drafts. None where transformers lacks it."""
    try:
        from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
    except ImportError:  # transformers < 5.16
        return None
    tcfg = target.config
    head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    cfg = MuseGlimmerAssistantConfig(
        hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size, num_hidden_layers=1,
        num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
        head_dim=head_dim, max_position_embeddings=4096, layer_types=["full_attention"],
        block_size=NUM_DRAFTS + 1, mask_token_id=tcfg.vocab_size - 1, target_layer_ids=list(target_layer_ids),
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    torch.manual_seed(1)
    param = next(target.parameters())
    return MuseGlimmerAssistantModel(cfg).to(device=param.device, dtype=param.dtype).eval()


def build_classic_assistant(family: str, target) -> torch.nn.Module:
    """A one-layer model of the target's family with a constant γ-token schedule and no confidence early stop."""
    assistant = build_target(family, target.config.vocab_size, seed=2, num_layers=1)
    gen = assistant.generation_config
    gen.num_assistant_tokens, gen.num_assistant_tokens_schedule, gen.assistant_confidence_threshold = (
        NUM_DRAFTS, "constant", 0.0)
    param = next(target.parameters())
    return assistant.to(device=param.device, dtype=param.dtype)


@dataclass
class Setup:
    """One target with everything that drafts for it, on one device."""

    family: str
    target: torch.nn.Module
    dspark: DSparkDraftModel
    dflash: torch.nn.Module | None
    assistant: torch.nn.Module
    device: torch.device
    dspark_dflash: DSparkDraftModel | None = None  # ``dflash``'s weights in hf-dspark (Qwen3 targets)


def build_setup(family: str, vocab_size: int, device: torch.device, dtype: torch.dtype) -> Setup:
    if family == "smollm2":
        vocab_size = shipped_drafter_config()["vocab_size"]
    target = build_target(family, vocab_size).to(device=device, dtype=dtype)
    dspark = build_dspark_drafter(family, target)
    dflash = build_dflash_assistant(target, dspark.config.target_layer_ids)
    return Setup(family, target, dspark, dflash, build_classic_assistant(family, target), device,
                 dspark_dflash=load_dflash_in_dspark(target, dflash))


def load_dflash_in_dspark(target, dflash) -> DSparkDraftModel | None:
    """transformers' DFlash assistant saved in its own format and loaded by hf-dspark: the same weights and the
    same drafts (tests/generation/test_dflash_interop.py), so it times our loop against transformers' with one
    drafter. None where that dialect does not load (no DFlash in transformers, non-Qwen3 targets)."""
    if dflash is None or target.config.model_type != "qwen3":
        return None
    with tempfile.TemporaryDirectory() as tmp:
        dflash.save_pretrained(tmp)
        return DSparkDraftModel.from_pretrained(tmp, target=target).eval()  # binding casts, RoPE kept float32


def variant_kwargs(variant: str, num_tokens: int) -> dict:
    if variant == "min_new_tokens":
        return {"min_new_tokens": num_tokens}
    if variant == "repetition_penalty":
        return {"repetition_penalty": REPETITION_PENALTY}
    return {}


def greedy_continuations(setup: Setup, prompts: torch.Tensor, num_tokens: int, variant: str) -> torch.Tensor:
    """Plain greedy continuation [B, N + γ + 2] of every prompt (extra tokens: the last rounds' drafts)."""
    extra = {"repetition_penalty": REPETITION_PENALTY} if variant == "repetition_penalty" else {}
    with torch.no_grad():
        out = setup.target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                    max_new_tokens=num_tokens + NUM_DRAFTS + 2, pad_token_id=PAD_ID, **extra)
    cont = out[:, prompts.shape[1]:]
    if cont.shape[1] != num_tokens + NUM_DRAFTS + 2:
        raise RuntimeError("the greedy continuation stopped early (EOS won greedy decoding); change --seed")
    return cont


# ---------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    family: str
    accept: str
    num_tokens: int
    batch: int
    variant: str


def applicable(impl: str, cfg: Config, setup: Setup) -> str | None:
    """None when ``impl`` runs on ``cfg``, else why not (reported in the table as n/a)."""
    if impl == "dflash" and setup.dflash is None:
        return f"transformers {transformers.__version__} has no DFlash loop"
    if impl == "dspark-dflash" and setup.dspark_dflash is None:
        return "transformers' DFlash assistants (Qwen3-style layers) load for Qwen3 targets only"
    if impl in ("dflash", "dspark-dflash", "assisted", "plain") and cfg.variant == "threshold":
        return "hf-dspark's confidence threshold only"
    if impl in ("dflash", "assisted") and cfg.batch > 1:
        return "transformers: assisted generate is only supported for batch_size = 1"
    if impl == "engine" and cfg.variant != "plain":
        return "the engine's SamplingParams have no such processor"
    return None


def generate_call(impl: str, setup: Setup, cfg: Config, prompts: torch.Tensor) -> torch.Tensor:
    """The implementation's public entry point; returns the generated tokens [B, N]."""
    n, target = cfg.num_tokens, setup.target
    common = dict(attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=n, pad_token_id=PAD_ID,
                  **variant_kwargs(cfg.variant, n))
    if impl == "engine":
        engine = DSparkEngine(target, setup.dspark, policy="fixed", max_running_requests=cfg.batch)
        return torch.tensor([o.token_ids for o in engine.generate(list(prompts), max_new_tokens=n)])
    if impl == "dspark":
        threshold = 1e-9 if cfg.variant == "threshold" else 0.0
        out = target.generate(prompts, assistant_model=setup.dspark, dspark_num_tokens=NUM_DRAFTS,
                              dspark_confidence_threshold=threshold, **common)
    elif impl == "dspark-dflash":
        out = target.generate(prompts, assistant_model=setup.dspark_dflash, dspark_num_tokens=NUM_DRAFTS,
                              dspark_confidence_threshold=0.0, **common)
    elif impl == "plain":
        out = target.generate(prompts, **common)
    elif impl == "dflash":
        out = target.generate(prompts, assistant_model=setup.dflash, speculation_type="dflash", **common)
    else:
        out = target.generate(prompts, assistant_model=setup.assistant, **common)
    return out[:, prompts.shape[1]:]


def run_once(impl: str, setup: Setup, cfg: Config, prompts: torch.Tensor, continuation: torch.Tensor,
             count_syncs: bool) -> RunMeasurement:
    """One generate call under the oracle; records whether its output is the greedy continuation."""
    gc.collect()  # no collection of an earlier run's garbage inside this one's window
    counter = SyncCounter(setup.device) if count_syncs else None
    num_right = ACCEPTED[cfg.accept]
    with contextlib.ExitStack() as stack, torch.no_grad():
        probe = stack.enter_context(Probe(setup.target, setup.device, counter))
        if impl in ("dspark", "engine", "dspark-dflash"):
            draft = setup.dspark_dflash if impl == "dspark-dflash" else setup.dspark
            stack.enter_context(dspark_oracle(draft, continuation, num_right, probe))
        elif impl != "plain":
            stack.enter_context(transformers_oracle(setup.target, continuation, num_right, probe))
        with counter if counter is not None else contextlib.nullcontext():
            generated = generate_call(impl, setup, cfg, prompts)
        if setup.device.type == "cuda":
            torch.cuda.synchronize()  # outside the counter: the benchmark's own sync is not the loop's
        end, end_cpu = time.perf_counter(), time.process_time()
    if probe.window_start is None or probe.rounds == 0:
        raise RuntimeError(f"{impl} on {cfg}: no decode round was seen")
    measurement = probe.measurement(end, end_cpu)
    measurement.identical = torch.equal(generated.cpu(), continuation[:, :cfg.num_tokens].cpu())
    return measurement


@dataclass
class Result:
    """Medians of one (configuration, implementation) over the timed repeats."""

    model: str
    accept: str
    num_tokens: int
    batch: int
    variant: str
    impl: str
    rounds: int | None = None
    tokens_per_round: float | None = None
    ms_per_round: float | None = None
    cpu_ms_per_round: float | None = None
    forward_ms: float | None = None
    draft_ms: float | None = None
    host_ms: float | None = None
    syncs_per_round: float | None = None
    syncs_loop_per_round: float | None = None
    syncs_forward_per_round: float | None = None
    h2d_per_round: float | None = None
    ops_per_round: float | None = None  # aten ops dispatched per round (counting run): loop + forward + drafter
    ops_loop_per_round: float | None = None
    ops_draft_per_round: float | None = None
    repeats_ms: list[float] = field(default_factory=list)
    status: str = "ok"


def summarize(impl: str, cfg: Config, counted: RunMeasurement, timed: list[RunMeasurement]) -> Result:
    rounds = counted.rounds
    # tokens committed before the window: the prefill's first token, or (assisted) the whole first round,
    # which transformers verifies in its prefill forward
    before = ACCEPTED[cfg.accept] + 1 if impl == "assisted" else 1
    med = lambda values: statistics.median(values) * 1e3  # noqa: E731 - seconds per round -> ms
    ms = med([m.window_s / m.rounds for m in timed])
    cpu_ms = med([m.window_cpu_s / m.rounds for m in timed])
    fwd = med([m.forward_s / m.rounds for m in timed])
    drf = med([m.draft_s / m.rounds for m in timed])
    # the split is in the forward clocks' unit: device time on CUDA (against wall time), CPU time on a CPU
    split_of = ms if counted.on_cuda else cpu_ms
    return Result(cfg.family, cfg.accept, cfg.num_tokens, cfg.batch, cfg.variant, impl, rounds=rounds,
                  tokens_per_round=round((cfg.num_tokens - before) / rounds, 2), ms_per_round=round(ms, 3),
                  cpu_ms_per_round=round(cpu_ms, 3), forward_ms=round(fwd, 3), draft_ms=round(drf, 3),
                  host_ms=round(split_of - fwd - drf, 3),
                  syncs_per_round=round((counted.syncs_loop + counted.syncs_forward) / rounds, 2),
                  syncs_loop_per_round=round(counted.syncs_loop / rounds, 2),
                  syncs_forward_per_round=round(counted.syncs_forward / rounds, 2),
                  h2d_per_round=round(counted.h2d / rounds, 2),
                  ops_per_round=round((counted.ops_loop + counted.ops_forward + counted.ops_draft) / rounds, 1),
                  ops_loop_per_round=round(counted.ops_loop / rounds, 1),
                  ops_draft_per_round=round(counted.ops_draft / rounds, 1),
                  repeats_ms=[round(m.window_s / m.rounds * 1e3, 3) for m in timed],
                  status="ok" if all(m.identical for m in [counted, *timed]) else "output differs from greedy")


def bench_group(setup: Setup, family: str, accept: str, num_tokens: int, batch: int, variant: str,
                impls: list[str], repeats: int, prompts: torch.Tensor, continuation: torch.Tensor) -> list[Result]:
    """All implementations on one configuration: a counting run each (also the warm-up), then ``repeats``
    timed runs interleaved across implementations (rotating which goes first)."""
    cfg = Config(family, accept, num_tokens, batch, variant)
    why_not = {impl: applicable(impl, cfg, setup) for impl in impls}
    live = [impl for impl in impls if why_not[impl] is None]
    results = {impl: Result(family, accept, num_tokens, batch, variant, impl,
                            status=f"{NOT_APPLICABLE}: {why_not[impl]}") for impl in impls}
    counted = {impl: run_once(impl, setup, cfg, prompts, continuation, count_syncs=True) for impl in live}
    timed: dict[str, list[RunMeasurement]] = {impl: [] for impl in live}
    for rep in range(repeats):
        order = live[rep % len(live):] + live[:rep % len(live)] if live else []
        for impl in order:
            timed[impl].append(run_once(impl, setup, cfg, prompts, continuation, count_syncs=False))
    for impl in live:
        results[impl] = summarize(impl, cfg, counted[impl], timed[impl])
        logger.info("%s %s N=%d B=%d %s %-8s %.3f ms/round, %.1f syncs/round", family, accept, num_tokens, batch,
                    variant, impl, results[impl].ms_per_round, results[impl].syncs_per_round)
    return [results[impl] for impl in impls]


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------
COLUMNS = [("model", "model"), ("accept", "accept"), ("num_tokens", "N"), ("batch", "B"), ("variant", "variant"),
           ("impl", "impl"), ("tokens_per_round", "τ"), ("ms_per_round", "ms/round"), ("cpu_ms_per_round", "cpu ms"),
           ("syncs_per_round", "syncs/round"), ("syncs_loop_per_round", "loop"), ("syncs_forward_per_round", "fwd"),
           ("h2d_per_round", "h2d"), ("ops_per_round", "ops/round"), ("ops_loop_per_round", "loop ops"),
           ("ops_draft_per_round", "draft ops"), ("forward_ms", "fwd ms"), ("draft_ms", "draft ms"),
           ("host_ms", "host ms"), ("status", "status")]


def markdown_table(results: list[Result]) -> str:
    """One row per measured (configuration, implementation); n/a rows only where transformers refuses a batch."""
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        if r.status.startswith(NOT_APPLICABLE) and "batch_size" not in r.status:
            continue
        row = asdict(r)
        cells = [str(row[key]) if row[key] is not None else NOT_APPLICABLE for key, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def growth_table(results: list[Result]) -> str:
    """ms/round at the longest N over the shortest, per (model, accept, batch, variant, impl), in wall and CPU
    time (the goal of issue #15: at most 1.15×)."""
    by_key: dict[tuple, dict[int, Result]] = {}
    for r in results:
        if r.ms_per_round is not None:
            by_key.setdefault((r.model, r.accept, r.batch, r.variant, r.impl), {})[r.num_tokens] = r
    lines = ["| model | accept | B | variant | impl | N | growth (wall) | growth (cpu) |", "|---" * 8 + "|"]
    for key, per_n in by_key.items():
        if len(per_n) > 1:
            lo, hi = per_n[min(per_n)], per_n[max(per_n)]
            lines.append("| " + " | ".join(map(str, key)) + f" | {lo.num_tokens}→{hi.num_tokens} | "
                         f"{hi.ms_per_round / lo.ms_per_round:.2f}× | "
                         f"{hi.cpu_ms_per_round / lo.cpu_ms_per_round:.2f}× |")
    return "\n".join(lines) if len(lines) > 2 else ""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama", "qwen3"], choices=list(FAMILIES))
    parser.add_argument("--accept", nargs="+", default=list(ACCEPTED), choices=list(ACCEPTED))
    parser.add_argument("--tokens", nargs="+", type=int, default=[256, 2048], help="generated tokens N")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--impls", nargs="+", default=list(DEFAULT_IMPLS), choices=list(IMPLS))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration and implementation")
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny models gain nothing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke (seconds): llama, 4of7, N=16, batch 1 and 2, plain and repetition_penalty, "
                             "1 repeat")
    parser.add_argument("--out", type=Path, default=None, help="directory for bench_overhead.json / .md")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.accept, args.tokens, args.batch, args.repeats = ["llama"], ["4of7"], [16], [1, 2], 1
        args.variants = [v for v in args.variants if v in ("plain", "repetition_penalty")] or ["plain"]
    return args


def run(args: argparse.Namespace) -> dict:
    """The whole matrix; returns the JSON document (also written under ``--out``). ``args.deadline`` (a
    ``time.perf_counter()`` value, optional) skips the configurations that would start after it."""
    deadline = getattr(args, "deadline", None)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    results: list[Result] = []
    started = time.perf_counter()
    for family in args.models:
        setup = build_setup(family, args.vocab_size, device, dtype)
        gen = torch.Generator().manual_seed(args.seed)
        vocab_size = setup.target.config.vocab_size
        prompts_all = torch.randint(3, vocab_size - 1, (max(args.batch), PROMPT_LEN), generator=gen).to(device)
        continuations = {}
        for variant in args.variants:
            key = "repetition_penalty" if variant == "repetition_penalty" else "plain"
            if key not in continuations:
                continuations[key] = greedy_continuations(setup, prompts_all, max(args.tokens), key)
        for batch, num_tokens, accept, variant in itertools.product(args.batch, args.tokens, args.accept,
                                                                    args.variants):
            if deadline is not None and time.perf_counter() > deadline:  # a caller's time budget is spent
                results += [Result(family, accept, num_tokens, batch, variant, impl, status="skipped: time budget")
                            for impl in args.impls]
                continue
            key = "repetition_penalty" if variant == "repetition_penalty" else "plain"
            results += bench_group(setup, family, accept, num_tokens, batch, variant, args.impls, args.repeats,
                                   prompts_all[:batch], continuations[key][:batch])
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "hf_dspark": __version__,
            "python": platform.python_version(), "device": str(device), "dtype": args.dtype,
            "threads": args.threads, "num_drafts": NUM_DRAFTS, "prompt_len": PROMPT_LEN,
            "vocab_size": args.vocab_size, "repeats": args.repeats, "seconds": round(time.perf_counter() - started, 1),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()}
    return {"meta": meta, "results": [asdict(r) for r in results]}


def main(argv=None) -> dict:
    """``scripts/bench_overhead.py``: run, log the tables, write them under ``--out``; returns the JSON document."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("hf_dspark").setLevel(logging.WARNING)  # one stats line per generate call otherwise
    logger.setLevel(logging.INFO)  # this benchmark's own progress lines
    warnings.filterwarnings("ignore", message=".*generation flags are not valid.*")
    args = parse_args(argv)
    doc = run(args)
    results = [Result(**r) for r in doc["results"]]
    table = markdown_table(results)
    growth = growth_table(results)
    report = table + ("\n\nGrowth of ms/round with N:\n\n" + growth if growth else "")
    logger.info("\n%s", report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_overhead.json").write_text(json.dumps(doc, indent=1))
        (args.out / "bench_overhead.md").write_text(report + "\n")
        logger.info("wrote %s", args.out / "bench_overhead.json")
    return doc
