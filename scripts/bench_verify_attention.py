"""What one verify forward of R rows × W tokens costs with transformers' SDPA attention and with hf-dspark's
GQA-folded attention (``hf_dspark.cpu_kernels.folded_gqa_attention``), both under the skinny CPU linears.

Every row sits on its own prefilled KV cache of ``--context`` slots with a few holes (masked slots, as rejected
drafts leave them in the engine's batch), so the forward builds and applies a padding mask the way an engine step
does. The (R, W, attention) cells run in rotating order, ``--repeats`` times; medians in ms. It also checks that
both attentions give the same next tokens and reports the largest logit difference.

    python scripts/bench_verify_attention.py --rows 1 4 16 --widths 1 2 3 5 9 --repeats 9 --out DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from hf_dspark.cpu_kernels import folded_gqa_attention, skinny_linears
from hf_dspark.loading import load_target
from hf_dspark.scheduling.forward_timing import prefill_context

ATTENTIONS = ("sdpa", "folded")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target directory (default: the embedded SmolLM2)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    p.add_argument("--context", type=int, default=300, help="prefilled slots under every row")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _ = load_target(args.target)
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        context = prefill_context(target, args.context, device=torch.device("cpu"), generator=generator)
    cells = {}
    for rows in args.rows:
        cache = copy.deepcopy(context)
        cache.batch_repeat_interleave(rows)
        for width in args.widths:
            mask = torch.ones(rows, args.context + width, dtype=torch.long)
            mask[:, args.context - 12: args.context - 8] = 0  # holes, as rejected drafts leave them
            ids = torch.randint(0, vocab, (rows, width), generator=generator)
            positions = (args.context + torch.arange(width)).expand(rows, -1)
            cells[rows, width] = (cache, mask, ids, positions)

    def forward(rows: int, width: int, attention: str) -> tuple[torch.Tensor, float]:
        cache, mask, ids, positions = cells[rows, width]
        cache = copy.deepcopy(cache)
        start = time.perf_counter()
        with torch.inference_mode(), skinny_linears(target), (
                folded_gqa_attention(target) if attention == "folded" else nullcontext()):
            logits = target(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True, logits_to_keep=width).logits
        return logits, time.perf_counter() - start

    configs = [(r, w, a) for r in args.rows for w in args.widths for a in ATTENTIONS]
    seconds = {c: [] for c in configs}
    agreement, max_diff = True, 0.0
    for rows in args.rows:  # warm-up, and the two attentions' logits side by side
        for width in args.widths:
            stock, folded = (forward(rows, width, a)[0] for a in ATTENTIONS)
            agreement &= bool(torch.equal(stock.argmax(-1), folded.argmax(-1)))
            max_diff = max(max_diff, float((stock - folded).abs().max()))
    for r in range(args.repeats):
        shift = r % len(configs)
        for config in configs[shift:] + configs[:shift]:
            seconds[config].append(forward(*config)[1])
    results = [{"rows": r, "width": w, "attention": a, "ms": 1e3 * statistics.median(seconds[r, w, a])}
               for r, w, a in configs]
    lines = ["| rows | width | SDPA ms | folded ms | folded ÷ SDPA |", "|---" * 5 + "|"]
    for rows in args.rows:
        for width in args.widths:
            stock, folded = (1e3 * statistics.median(seconds[rows, width, a]) for a in ATTENTIONS)
            lines.append(f"| {rows} | {width} | {stock:.1f} | {folded:.1f} | {folded / stock:.2f} |")
    summary = f"same next tokens: {agreement}; largest logit difference: {max_diff:.2e}"
    print("\n".join(lines) + "\n\n" + summary)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_verify_attention.json").write_text(json.dumps(
            {"results": results, "same_next_tokens": agreement, "max_logit_difference": max_diff,
             "context": args.context, "threads": args.threads}, indent=1))
        (out / "bench_verify_attention.md").write_text("\n".join(lines) + "\n\n" + summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
