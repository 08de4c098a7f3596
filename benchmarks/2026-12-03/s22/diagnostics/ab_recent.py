"""A/B: the streak vs the long-run mean alone (recent_weight 0), fused generate, T = 0, interleaved.

Runs at 1259bca only (the reverted streak). ``python ab_recent.py MT CHAT [blend|max]``: "blend" (default) weighs
the round before 0.5 (ab_streak_blend.txt); "max" only lets it raise the mean (ab_streak_max.txt)."""
import sys, time, logging, torch, numpy as np
torch.set_num_threads(2)
sys.path.insert(0, "/work/main/scripts")
from bench_fusion import render, HELDOUT_DIR, read_heldout
from hf_dspark.evaluation.benchmarks import default_eval_dir
from hf_dspark.training.prompts import read_prompts
from hf_dspark.scheduling.policies import ScheduledPolicy
from hf_dspark.loading import load_drafter, load_target
logging.basicConfig(level=logging.WARNING)
target, tok = load_target(None)
drafter = load_drafter(None, target).model
pols = {}
from hf_dspark.scheduling.policies import _zero_padded


class MaxPolicy(ScheduledPolicy):
    def _drafter_estimate(self):
        last, self._last_survival = self._last_survival, None
        if last is None or self.mean_survival is None:
            return self.mean_survival
        width = max(last.size, self.mean_survival.size)
        mean = _zero_padded(self.mean_survival, width)
        return np.maximum(mean, 0.5 * mean + 0.5 * _zero_padded(last, width))


pols["recent 0.5"] = MaxPolicy() if sys.argv[3:] == ["max"] else ScheduledPolicy()
pols["recent 0"] = ScheduledPolicy()
pols["recent 0"].recent_weight = 0.0
arms = {"lookup only": {"dspark_lookup": "only", "dspark_lookup_scope": "lookup"}}
arms.update({n: {"dspark_lookup_scope": n, "dspark_policy": p} for n, p in pols.items()})
convs = []
for p in read_prompts(default_eval_dir() / "mt-bench.jsonl")[:int(sys.argv[1])]:
    first = [{"role": "user", "content": p.turns[0]}]
    ids = render(tok, first)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=96, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    convs.append(("mt-t1", first)); convs.append(("mt-t2", first + [{"role": "assistant", "content": text}, {"role": "user", "content": p.turns[1]}]))
for p in read_heldout(HELDOUT_DIR / "chat.jsonl")[:int(sys.argv[2])]:
    convs.append(("chat", [{"role": "user", "content": p.text}]))
tot = {}
names = list(arms)
for i, (kind, msgs) in enumerate(convs):
    ids = render(tok, msgs)
    row = {}
    order = names[i % 3:] + names[:i % 3]
    for n in order:
        t = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=96, do_sample=False, assistant_model=drafter, pad_token_id=tok.pad_token_id, **arms[n])
        s = time.perf_counter() - t
        k = out.shape[1] - ids.shape[1]
        row[n] = (k, s, dict((a, b.rounds) for a, b in drafter.stats.by_source.items()))
        tot.setdefault((kind, n), [0, 0.0]); tot[(kind, n)][0] += k; tot[(kind, n)][1] += s
    print(kind, i, "  ".join(f"{n}: {k/s:5.1f} t/s {r}" for n, (k, s, r) in row.items()), flush=True)
for kind in ("mt-t1", "mt-t2", "chat"):
    r = {n: tot[(kind, n)][0] / tot[(kind, n)][1] for n in names if (kind, n) in tot}
    print(kind, {n: round(v, 1) for n, v in r.items()}, "A/B", round(r["recent 0.5"] / r["recent 0"], 3))
