"""Produce a drafter's training set: prompts answered by the target itself (the published recipe).

Prompts come from your files (jsonl with ``turns``, ShareGPT ``conversations`` or OpenAI ``messages``;
``--prompts``), from templates (``--num-template``), and/or from the target itself (Magpie: the instruct model
writes user requests when given only the user-turn prefix; ``--num-magpie``). All are de-duplicated and refused
if they overlap the evaluation benchmarks. Answers come from the local target (batched ``generate``, or the
continuous-batching engine with ``--backend engine``) or from any OpenAI-compatible server (``--endpoint``).

Resumable: rerun the same command and it continues where it stopped (prompts are fixed by the seed, answers
already in the output file are skipped). Examples:

    python scripts/regenerate.py --out data/smollm2 --num-template 6000 --num-magpie 1500      # embedded SmolLM2
    python scripts/regenerate.py --target Qwen/Qwen3-0.6B --prompts my_prompts.jsonl --num-template 0 \\
        --num-magpie 0 --out data/qwen3
    python scripts/regenerate.py --target Qwen/Qwen3-8B --prompts my_prompts.jsonl --num-template 0 --num-magpie 0 \\
        --endpoint http://localhost:8000 --model-name Qwen/Qwen3-8B --out data/qwen3-8b     # a vLLM / SGLang server
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from hf_dspark.embedded import load_target
from hf_dspark.training.prompt_sources import TRAIN_CODE_MODULES, code_prompts, gsm8k_prompts
from hf_dspark.training.prompts import EvalOverlapGuard, Prompt, dedupe, read_prompts, synthesise_template_prompts
from hf_dspark.training.regenerate import (
    SamplingSettings,
    regenerate_endpoint,
    regenerate_local,
    regenerate_with_engine,
    synthesise_magpie_prompts,
)

MAGPIE_SYSTEMS = [
    None,
    "You are a helpful AI assistant. Users ask you math word problems.",
    "You are a helpful AI assistant. Users ask you to write Python code.",
    "You are a helpful AI assistant. Users ask you for advice, explanations and writing help.",
]


def _write_prompts(path: Path, prompts: list[Prompt]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"turns": list(p.turns), "category": p.category}, ensure_ascii=False) + "\n")


def interleave(*sources: list[Prompt]) -> list[Prompt]:
    """Round-robin over the sources, so an early stop still leaves a mix of all of them."""
    out = []
    for i in range(max((len(s) for s in sources), default=0)):
        out.extend(s[i] for s in sources if i < len(s))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/smollm2", help="folder for the prompt files and train.jsonl")
    parser.add_argument("--target", default=None, help="target model directory or Hub id (default: embedded SmolLM2)")
    parser.add_argument("--prompts", nargs="*", default=[], help="your prompt files (jsonl: turns / conversations / "
                                                                  "messages)")
    parser.add_argument("--eval-dir", default="../shared/eval_datasets",
                        help="evaluation prompts that must not be trained on")
    parser.add_argument("--sources", nargs="*", default=[], choices=["gsm8k", "code"],
                        help="real-source prompts: gsm8k = the GSM8K train questions (--gsm8k-file), code = requests "
                             "written from the standard library's functions and classes (prompt_sources.py)")
    parser.add_argument("--gsm8k-file", default="../shared/train_data/gsm8k_train.jsonl")
    parser.add_argument("--num-template", type=int, default=6000)
    parser.add_argument("--num-magpie", type=int, default=1500)
    parser.add_argument("--magpie-max-new-tokens", type=int, default=64,
                        help="length cap of a synthesised request (longer ones are dropped as rambling)")
    parser.add_argument("--backend", choices=["generate", "engine"], default="generate",
                        help="answer with batched target.generate, or with the continuous-batching DSparkEngine "
                             "(policy none: a finished answer frees its row at once)")
    parser.add_argument("--endpoint", default=None,
                        help="answer through an OpenAI-compatible server instead (e.g. http://localhost:8000); "
                             "the local target then only tokenises and writes Magpie prompts")
    parser.add_argument("--model-name", default=None, help="with --endpoint: the served model's name "
                                                           "(default: --target)")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--batch-size", type=int, default=24,
                        help="generate: prompts per batch; engine: requests decoding at once")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--temperature", type=float, default=0.2, help="the target's recommended sampling "
                                                                       "(SmolLM2: 0.2, top-p 0.9); 0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.endpoint and args.backend != "generate":
        parser.error("--endpoint answers on the server; --backend applies to local answering only")
    if args.endpoint and not (args.model_name or args.target):
        parser.error("--endpoint needs --model-name (or --target) to name the served model")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    guard = EvalOverlapGuard.from_dir(args.eval_dir)
    needs_model = args.num_magpie or not args.endpoint
    model, tokenizer = load_target(args.target) if needs_model else (None, None)

    template_file = out / "prompts_template.jsonl"
    if not template_file.exists():
        _write_prompts(template_file, synthesise_template_prompts(args.num_template, seed=args.seed, guard=guard))
    magpie_file = out / "prompts_magpie.jsonl"
    if args.num_magpie:  # resumable: continues an interrupted synthesis from the prompts already written
        synthesise_magpie_prompts(model, tokenizer, args.num_magpie, seed=args.seed, system_prompts=MAGPIE_SYSTEMS,
                                  guard=guard, out_path=magpie_file, max_new_tokens=args.magpie_max_new_tokens)
    own = dedupe([p for path in args.prompts for p in read_prompts(path)])
    template = read_prompts(template_file)[: args.num_template]
    magpie = read_prompts(magpie_file)[: args.num_magpie] if magpie_file.exists() else []
    sources = []
    if "gsm8k" in args.sources:
        sources.append(gsm8k_prompts(args.gsm8k_file, guard=guard))
    if "code" in args.sources:
        sources.append(code_prompts(TRAIN_CODE_MODULES, seed=args.seed, guard=guard))
    prompts = interleave(own, template, magpie, *sources)
    guard.raise_if_overlapping(prompts)
    logging.info("%d prompts: %d yours, %d templated, %d Magpie, %s from sources", len(prompts), len(own), len(template),
                 len(magpie), [len(s) for s in sources])
    settings = SamplingSettings(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    train_file = out / "train.jsonl"
    if args.endpoint:
        regenerate_endpoint(args.endpoint, args.model_name or args.target, prompts, train_file, settings=settings,
                            api_key=args.api_key)
    elif args.backend == "engine":
        from hf_dspark.serving import DSparkEngine

        engine = DSparkEngine(model, policy="none", max_running_requests=args.batch_size, tokenizer=tokenizer,
                              max_batch_tokens=args.batch_size * 1024)
        regenerate_with_engine(engine, tokenizer, prompts, train_file, settings=settings, seed=args.seed)
    else:
        regenerate_local(model, tokenizer, prompts, train_file, settings=settings, batch_size=args.batch_size,
                         seed=args.seed)


if __name__ == "__main__":
    main()
