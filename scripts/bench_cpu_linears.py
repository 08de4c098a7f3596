"""What one target forward costs with stock ``F.linear`` and with hf-dspark's skinny CPU linears, per width.

The forward of ``w`` new tokens on top of a prefilled KV cache (what a plain decoding step is at w = 1 and a
verify of w - 1 drafts is otherwise), stock and inside ``hf_dspark.cpu_kernels.skinny_linears``, every
(width, kernel) pair in rotating order, ``--repeats`` times; medians in ms and × the stock 1-token step. It also
checks that both kernels give the same next tokens and reports the largest logit difference.

    python scripts/bench_cpu_linears.py --widths 1 2 3 4 6 8 12 16 17 32 --repeats 9 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_dspark.cpu_kernels import SKINNY_KERNEL, skinny_linears
from hf_dspark.loading import load_target


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target directory (default: the embedded SmolLM2)")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 17, 32])
    p.add_argument("--context", type=int, default=384, help="prefilled tokens under every forward")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _ = load_target(args.target)
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, args.context + max(args.widths)), generator=torch.Generator().manual_seed(0))
    configs = [(w, kernel) for w in args.widths for kernel in ("stock", SKINNY_KERNEL)]
    seconds = {c: [] for c in configs}
    agreement, max_diff = True, 0.0
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=ids[:, : args.context], use_cache=True, past_key_values=cache)

        def forward(width: int, kernel: str) -> torch.Tensor:
            new = ids[:, args.context: args.context + width]
            positions = torch.arange(args.context, args.context + width)[None]
            with skinny_linears(target) if kernel == SKINNY_KERNEL else nullcontext():
                logits = target(input_ids=new, position_ids=positions, past_key_values=cache, use_cache=True,
                                logits_to_keep=width).logits
            cache.crop(-width)
            return logits

        for width in args.widths:  # warm-up, and the two kernels' logits side by side
            stock, skinny = forward(width, "stock"), forward(width, SKINNY_KERNEL)
            agreement &= bool(torch.equal(stock.argmax(-1), skinny.argmax(-1)))
            max_diff = max(max_diff, float((stock - skinny).abs().max()))
        for r in range(args.repeats):
            shift = r % len(configs)
            for config in configs[shift:] + configs[:shift]:
                start = time.perf_counter()
                forward(*config)
                seconds[config].append(time.perf_counter() - start)
    base = statistics.median(seconds[(1, "stock")])
    rows = [{"width": w, "kernel": k, "ms": 1e3 * statistics.median(seconds[(w, k)]),
             "x_stock_step": statistics.median(seconds[(w, k)]) / base} for w, k in configs]
    lines = ["| width | stock ms | × stock step | skinny ms | × stock step | skinny ÷ stock |", "|---" * 6 + "|"]
    for w in args.widths:
        s, k = (next(r for r in rows if r["width"] == w and r["kernel"] == kern) for kern in ("stock", SKINNY_KERNEL))
        lines.append(f"| {w} | {s['ms']:.1f} | {s['x_stock_step']:.2f} | {k['ms']:.1f} | {k['x_stock_step']:.2f} | "
                     f"{k['ms'] / s['ms']:.2f} |")
    summary = f"same next tokens: {agreement}; largest logit difference: {max_diff:.2e}"
    print("\n".join(lines) + "\n\n" + summary)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_cpu_linears.json").write_text(json.dumps({"rows": rows, "same_next_tokens": agreement,
                                                                "max_logit_difference": max_diff,
                                                                "context": args.context,
                                                                "threads": args.threads}, indent=1))
        (out / "bench_cpu_linears.md").write_text("\n".join(lines) + "\n\n" + summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
