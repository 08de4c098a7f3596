"""What a bigger drafter costs per round on this machine: drafting pass time for each drafter shape, next to the
target's verify step, so the τ a shape would have to buy to pay is known before training it.

Shapes: backbone layers, Markov rank, draft vocabulary size (random weights: the cost does not depend on them), each
timed as the loop runs the drafter (a pass between target forwards, batch 1, on a context of ``--context`` tokens,
inside hf-dspark's CPU kernels). "τ to pay" is the τ at which drafting + verify(1, 8) costs what τ plain steps do:
(draft + verify_8) / verify_1, the round's cost in plain steps.

    python scripts/bench_drafter_capacity.py --out benchmarks/current/drafter_capacity
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, loop_kernels
from hf_dspark.loading import load_target
from hf_dspark.scheduling.forward_timing import prefill_context, time_draft_passes, time_padded_verify_widths

SHAPES = [  # (layers, markov rank, draft vocabulary; None = the target's whole vocabulary)
    (1, 128, 8192), (2, 128, 8192), (3, 128, 8192), (2, 64, 8192), (2, 256, 8192), (2, 128, 4096),
    (2, 128, 16384), (2, 128, None), (2, 0, 8192)]


def drafter_of(target, layers: int, rank: int, vocab: int | None) -> DSparkDraftModel:
    torch.manual_seed(0)
    ids = None if vocab is None else list(range(vocab))
    head = "markov" if rank else "none"
    return DSparkDraftModel.from_target(target, num_layers=layers, head=head, markov_rank=max(rank, 1),
                                        draft_vocab=ids, use_confidence_head=bool(rank)).eval()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/drafter_capacity")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _ = load_target()
    generator = torch.Generator().manual_seed(0)
    device = next(target.parameters()).device
    rows = []
    with torch.no_grad():
        for layers, rank, vocab in SHAPES:
            drafter = drafter_of(target, layers, rank, vocab)
            with loop_kernels(target, drafter):
                context = prefill_context(target, args.context, device=device, generator=generator)
                verify_1, verify_8 = time_padded_verify_widths(target, 1, [1, 8], context_len=args.context,
                                                               repeats=args.repeats, device=device,
                                                               generator=generator, context=context)
                (draft,) = time_draft_passes(target, drafter, [1], context_len=args.context, repeats=args.repeats,
                                             device=device, generator=generator, budget_s=float("inf"))
            rows.append({"layers": layers, "markov_rank": rank, "draft_vocab": vocab or "full",
                         "draft_ms": 1e3 * draft, "verify_1_ms": 1e3 * verify_1, "verify_8_ms": 1e3 * verify_8,
                         "tau_to_pay": (draft + verify_8) / verify_1})
    lines = ["| layers | Markov rank | draft vocabulary | drafting ms / round | verify(1) ms | verify(8) ms | "
             "τ to pay |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['markov_rank'] or 'none (DFlash)'} | {r['draft_vocab']} | "
                     f"{r['draft_ms']:.1f} | {r['verify_1_ms']:.1f} | {r['verify_8_ms']:.1f} | {r['tau_to_pay']:.2f} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"context": args.context, "rows": rows}, indent=2))
    (out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
