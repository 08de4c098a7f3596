"""Per-step trace of the engine at C=16: width, rows, committed tokens, wall time, predicted cost."""
import sys, time, json, torch, collections
torch.set_num_threads(2)
from hf_dspark.loading import load_target, load_drafter
from hf_dspark.evaluation.serving_bench import serving_prompts, parse_policy, run_level
from hf_dspark.serving import DSparkEngine
from hf_dspark.generation.memory import LONG_MATCH_TOKENS
from hf_dspark.generation import speculative_round as sr
target, tok = load_target()
drafter = load_drafter(None, target).model
prompts = serving_prompts(tok, None, 4, None, 512)
C = int(sys.argv[1]); labels = sys.argv[2].split(","); reps = int(sys.argv[3]) if len(sys.argv) > 3 else 1
slots = max(len(i) for _, i in prompts) + 64 + max(drafter.config.block_size, LONG_MATCH_TOKENS) + 1
trace = []
orig = sr.SpeculativeRound.run
def run(self, batch, processor, budgets, **kw):
    t = time.perf_counter()
    res = orig(self, batch, processor, budgets, **kw)
    el = time.perf_counter() - t
    cost = self.cost if self.policy.needs_step_cost else None
    pred = (cost.verify(len(budgets), res.width) + (cost.draft(len(budgets)) if res.block is not None else 0)) if cost is not None else None
    pred1 = cost.verify(len(budgets), 1) if cost is not None else None
    trace.append(dict(rows=len(budgets), width=res.width, tokens=sum(a + 1 for a in res.num_accepted),
                      drafted=res.block is not None, sec=el, pred=pred, pred1=pred1,
                      lookup=sum(s == "lookup" for s in (res.sources or [])),
                      expected=(self.policy.last_theta or 0) * (pred or 0) if res.width > 1 else None))
    if res.width > 1 and pred:
        print(f"      wide: rows {len(budgets)} width {res.width} lookup rows {trace[-1]['lookup']} lengths {sorted(res.lengths, reverse=True)[:6]} acc {sorted(res.num_accepted, reverse=True)[:6]} tokens {trace[-1]['tokens']} expected {trace[-1]['expected']:.1f} sec {el:.3f} pred {pred:.3f} pred1 {pred1:.3f}")
    return res
sr.SpeculativeRound.run = run
out = {}
for rep in range(reps):
  for label in labels:
    name, kw, ekw = parse_policy(label, 0.5)
    draft = ekw.pop("draft", drafter if name != "none" else None)
    eng = DSparkEngine(target, draft, name, policy_kwargs=kw, max_running_requests=C, max_batch_tokens=C*slots,
                       max_prefill_tokens=2048, tokenizer=tok, **ekw)
    if eng.policy.needs_step_cost: _ = eng.step_cost
    trace.clear()
    r = run_level(eng, prompts, C, 2*C, 64, {})
    print(f"rep{rep} {label:20s} tput {r['throughput']:.1f} steps {r['decode_steps']} verify_s {r['verify_s']:.2f} prefill_s {r['prefill_s']:.2f} wall {r['wall_s']:.2f}", flush=True)
    out[f"{rep}-{label}"] = list(trace)
    by = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
    for s in trace:
        key = (s["rows"] // 4 * 4, "w1" if s["width"] == 1 else "wide")
        b = by[key]; b[0] += 1; b[1] += s["tokens"]; b[2] += s["sec"]; b[3] += (s["pred"] or 0)
    for k in sorted(by): 
        n, tokc, sec, pred = by[k]; print(f"   rows~{k[0]:2d} {k[1]:4s} steps {n:3d} tok {tokc:4d} sec {sec:6.2f} tok/s {tokc/sec:6.1f} pred_s {pred:6.2f}")
json.dump(out, open(f"trace_{C}.json", "w"))  # in the working directory
