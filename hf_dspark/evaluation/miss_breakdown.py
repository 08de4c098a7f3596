"""Where a drafter's greedy τ goes: why each reached block slot was missed, and how sure the target was there.

τ only says how much; this says why, which decides what to train next. Every miss of a reached slot (its earlier
slots all accepted) gets one cause, in this order:

- ``outside_vocabulary``: the target's token is not in the drafter's draft vocabulary (no training reaches it);
- ``second``, ``third_to_fifth``, ``sixth_and_below``: the drafter ranked it that far down its candidates;
- ``not_a_candidate``: it is in the vocabulary but not among the candidates the block ranks.

Near misses (second choice) say the drafter knows the token and is outvoted; far ones say it does not. Position-1
acceptance is also split by the target's own top-1 probability at that position: a drafter that misses tokens the
target is sure of lacks capacity or training, one that only misses where the target hesitates is near what text this
uncertain allows. Scored like :func:`~hf_dspark.training.validation.greedy_block_acceptance` (teacher-forced blocks
from every anchor of a cache of the target's greedy answers), whose τ it reproduces.
"""

from __future__ import annotations

import torch

from ..training.anchors import IGNORE_LABEL
from ..training.validation import accepted_runs, draft_candidates, greedy_block_acceptance, teacher_forced_blocks

MISS_CAUSES = ("outside_vocabulary", "second", "third_to_fifth", "sixth_and_below", "not_a_candidate")
TARGET_CONFIDENCE_EDGES = (0.5, 0.8, 0.95)  # bins of the target's top-1 probability: <0.5, 0.5-0.8, 0.8-0.95, ≥0.95


def confidence_bin_names(edges: tuple[float, ...] = TARGET_CONFIDENCE_EDGES) -> list[str]:
    bounds = [0.0, *edges, 1.0]
    return [f"{lo:.2f}-{hi:.2f}" for lo, hi in zip(bounds[:-1], bounds[1:])]


def _target_top1_probability(lm_head: torch.nn.Module, last_hidden: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """[R, d] final target hidden states -> [R] the target's top-1 probability (fp32, in row chunks: V is large)."""
    out = []
    weight = lm_head.weight
    for rows in last_hidden.split(chunk):
        logits = torch.nn.functional.linear(rows.to(weight.dtype), weight).float()
        out.append(logits.softmax(-1).amax(-1))
    return torch.cat(out) if out else last_hidden.new_zeros(0)


@torch.no_grad()
def greedy_miss_breakdown(drafter, dataset, target_lm_head: torch.nn.Module, num_anchors: int = 128,
                          batch_size: int = 4, seed: int = 0,
                          confidence_edges: tuple[float, ...] = TARGET_CONFIDENCE_EDGES) -> dict:
    """Per block slot: how often it was reached and accepted, and each miss's cause; position 1 by target confidence.

    ``target_lm_head`` is the target's own output layer (the cache stores its final hidden states). Returns plain
    lists (JSON-ready): ``reached[k]``, ``accepted[k]``, ``misses[cause][k]`` with accepted + Σ misses = reached,
    ``tau_greedy``, and ``slot1_by_target_confidence``: per bin, slot 1's positions, acceptances and misses by cause."""
    gamma = drafter.config.block_size
    reached, accepted = torch.zeros(gamma, dtype=torch.long), torch.zeros(gamma, dtype=torch.long)
    misses = {cause: torch.zeros(gamma, dtype=torch.long) for cause in MISS_CAUSES}
    edges = torch.tensor(confidence_edges)
    bins_reached = torch.zeros(len(confidence_edges) + 1, dtype=torch.long)
    bins_accepted = torch.zeros_like(bins_reached)
    bins_missed = {cause: torch.zeros_like(bins_reached) for cause in MISS_CAUSES}
    in_vocab = None
    if drafter.draft_to_target is not None:
        in_vocab = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
        in_vocab[drafter.draft_to_target.cpu()] = True
    tau_sum, blocks = 0.0, 0
    was_training = drafter.training
    drafter.eval()
    for batch, targets, full, hidden in teacher_forced_blocks(drafter, dataset, num_anchors, batch_size, seed):
        labels, prev = targets.labels[full], targets.prev_ids[full]
        cand, vals = draft_candidates(drafter, hidden, prev.to(hidden.device))
        cand, vals = cand.cpu(), vals.cpu()
        order = vals.sort(dim=-1, descending=True, stable=True).indices  # ties as argmax breaks them
        ranked = cand.gather(-1, order)  # [M, γ, k] best first
        hit = ranked == labels[..., None]
        rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(labels, -1))  # 0 = drafted
        match = (rank == 0) & (labels != IGNORE_LABEL)
        run, alive = accepted_runs(match)
        alive = alive.bool()
        tau_sum += float((1 + run.sum(-1)).sum())
        blocks += run.shape[0]
        reached += alive.sum(0)
        accepted += run.sum(0)
        missed = alive & ~match
        outside = torch.zeros_like(missed) if in_vocab is None else ~in_vocab[labels.clamp(min=0)]
        cause_masks = {"outside_vocabulary": missed & outside,
                       "second": missed & ~outside & (rank == 1),
                       "third_to_fifth": missed & ~outside & (rank >= 2) & (rank <= 4),
                       "sixth_and_below": missed & ~outside & (rank >= 5),
                       "not_a_candidate": missed & ~outside & (rank < 0)}
        for cause, mask in cause_masks.items():
            misses[cause] += mask.sum(0)
        # slot 1 (always reached) against the target's confidence where it predicted that token
        rows = torch.arange(full.shape[0])[:, None].expand_as(full)[full]
        last = batch["target_last_hidden_states"][rows, targets.target_positions[full][:, 0]]
        top1 = _target_top1_probability(target_lm_head, last.to(target_lm_head.weight.device)).cpu()
        which = torch.bucketize(top1, edges, right=True)
        bins_reached += torch.bincount(which, minlength=len(bins_reached))
        bins_accepted += torch.bincount(which, weights=match[:, 0].double(), minlength=len(bins_reached)).long()
        for cause, mask in cause_masks.items():
            bins_missed[cause] += torch.bincount(which, weights=mask[:, 0].double(), minlength=len(bins_reached)).long()
    drafter.train(was_training)
    return {"blocks": blocks, "tau_greedy": tau_sum / max(blocks, 1),
            "reached": reached.tolist(), "accepted": accepted.tolist(),
            "misses": {cause: counts.tolist() for cause, counts in misses.items()},
            "slot1_by_target_confidence": {
                name: {"reached": int(bins_reached[b]), "accepted": int(bins_accepted[b]),
                       "misses": {cause: int(bins_missed[cause][b]) for cause in MISS_CAUSES}}
                for b, name in enumerate(confidence_bin_names(confidence_edges))}}


def breakdown_table(results: dict[str, dict]) -> str:
    """Markdown: per drafter (and prompt set), position-1 and all-slot shares of reached slots by outcome."""
    lines = ["| drafter | τ | slot | accepted | " + " | ".join(c.replace("_", " ") for c in MISS_CAUSES) + " |",
             "|---" * (4 + len(MISS_CAUSES)) + "|"]
    for name, r in results.items():
        for label, pick in (("1", slice(0, 1)), ("all", slice(None))):
            reached = max(sum(r["reached"][pick]), 1)
            shares = [sum(r["accepted"][pick]) / reached] + [sum(r["misses"][c][pick]) / reached for c in MISS_CAUSES]
            lines.append(f"| {name} | {r['tau_greedy']:.3f} | {label} | "
                         + " | ".join(f"{100 * s:.1f} %" for s in shares) + " |")
    return "\n".join(lines)


def confidence_table(results: dict[str, dict]) -> str:
    """Markdown: position-1 acceptance per bin of the target's top-1 probability (share of positions in brackets),
    then where the surest bin's misses go (shares of its positions)."""
    names = list(next(iter(results.values()))["slot1_by_target_confidence"])
    lines = ["| drafter | " + " | ".join(f"target p {n}" for n in names) + f" | misses at p {names[-1]}: "
             + ", ".join(c.replace("_", " ") for c in MISS_CAUSES) + " |", "|---" * (2 + len(names)) + "|"]
    for name, r in results.items():
        bins = r["slot1_by_target_confidence"]
        total = max(sum(b["reached"] for b in bins.values()), 1)
        cells = [f"{100 * b['accepted'] / max(b['reached'], 1):.1f} % ({100 * b['reached'] / total:.0f} %)"
                 for b in bins.values()]
        sure = bins[names[-1]]
        cells.append(" / ".join(f"{100 * sure['misses'][c] / max(sure['reached'], 1):.0f} %" for c in MISS_CAUSES))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


FEATURE_ABLATIONS = ("as given", "zeroed", "another conversation's", "with noise")


class FeaturesAblated(torch.utils.data.Dataset):
    """``dataset`` (a target cache) with the target's features replaced, to measure how much τ rests on them.

    ``"zeroed"``: all zero; ``"another conversation's"``: those of sample ``i + 1`` (cyclic), repeated or cut to
    this sample's length, so the drafter sees real target features of unrelated text; ``"with noise"``: Gaussian
    noise of half the features' own standard deviation added (seeded per sample). Tokens and labels are kept."""

    def __init__(self, dataset, ablation: str):
        if ablation not in FEATURE_ABLATIONS:
            raise ValueError(f"ablation {ablation!r}: choose from {', '.join(FEATURE_ABLATIONS)}")
        self.dataset, self.ablation = dataset, ablation

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = dict(self.dataset[i])
        features = item["target_hidden_states"]
        if self.ablation == "zeroed":
            features = torch.zeros_like(features)
        elif self.ablation == "another conversation's":
            other = self.dataset[(i + 1) % len(self.dataset)]["target_hidden_states"]
            repeats = -(-features.shape[0] // other.shape[0])  # ceil: enough copies to cover this sample
            features = torch.cat([other] * repeats)[:features.shape[0]]
        elif self.ablation == "with noise":
            generator = torch.Generator().manual_seed(i)
            exact = features.float()
            noise = torch.randn(exact.shape, generator=generator)
            features = (exact + 0.5 * exact.std() * noise).to(features.dtype)
        item["target_hidden_states"] = features
        return item


def feature_ablations(drafter, dataset, num_anchors: int = 128) -> dict[str, dict]:
    """Greedy τ and conditional acceptance per :data:`FEATURE_ABLATIONS`: a drafter whose τ barely drops without
    its target features drafts from the tokens alone (an n-gram model would do), one that falls to ~1 leans on them."""
    return {ablation: greedy_block_acceptance(drafter, FeaturesAblated(dataset, ablation), num_anchors=num_anchors)
            for ablation in FEATURE_ABLATIONS}


def ablation_table(results: dict[str, dict[str, dict]]) -> str:
    """Markdown: τ (position-1 acceptance) per drafter/prompt set (rows) and ablation (columns)."""
    lines = ["| drafter, prompt set | " + " | ".join(f"features {a}" for a in FEATURE_ABLATIONS) + " |",
             "|---" * (len(FEATURE_ABLATIONS) + 1) + "|"]
    for name, per_ablation in results.items():
        cells = [f"{r['tau_greedy']:.3f} ({100 * r['conditional_acceptance'][0]:.0f} %)"
                 for r in (per_ablation[a] for a in FEATURE_ABLATIONS)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = ["FEATURE_ABLATIONS", "MISS_CAUSES", "FeaturesAblated", "ablation_table", "breakdown_table",
           "confidence_table", "feature_ablations", "greedy_miss_breakdown"]
