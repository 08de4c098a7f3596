"""Interleaved arms at concurrency C: per-kind step statistics (R = C vs fewer rows; width 1 vs wide; drafted).

Usage: python trace_c4.py C ARMS REPEATS REQUESTS, e.g. 4 none,lookup-only,scheduled-nolookup,scheduled 3 8."""
import sys, time, collections, torch
torch.set_num_threads(2)
from hf_dspark.loading import load_target, load_drafter
from hf_dspark.evaluation.serving_bench import serving_prompts, parse_policy, run_level
from hf_dspark.serving import DSparkEngine
from hf_dspark.generation.memory import LONG_MATCH_TOKENS
from hf_dspark.generation import speculative_round as sr
target, tok = load_target()
drafter = load_drafter(None, target).model
prompts = serving_prompts(tok, None, 4, None, 512)
C = int(sys.argv[1]); labels = sys.argv[2].split(","); reps = int(sys.argv[3]); nreq = int(sys.argv[4])
slots = max(len(i) for _, i in prompts) + 64 + max(drafter.config.block_size, LONG_MATCH_TOKENS) + 1
trace = []
orig = sr.SpeculativeRound.run
def run(self, batch, processor, budgets, **kw):
    t = time.perf_counter(); res = orig(self, batch, processor, budgets, **kw); el = time.perf_counter() - t
    trace.append((len(budgets), res.width, sum(a + 1 for a in res.num_accepted), res.block is not None, el))
    return res
sr.SpeculativeRound.run = run
agg = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0, 0.0]))
tput = collections.defaultdict(list)
engines = {}
for rep in range(reps):
    for label in labels:
        name, kw, ekw = parse_policy(label, 0.5)
        draft = ekw.pop("draft", drafter if name != "none" else None)
        eng = DSparkEngine(target, draft, name, policy_kwargs=kw, max_running_requests=C, max_batch_tokens=C*slots,
                           max_prefill_tokens=2048, tokenizer=tok, **ekw)
        if eng.policy.needs_step_cost: _ = eng.step_cost
        trace.clear()
        r = run_level(eng, prompts, C, nreq, 64, {})
        tput[label].append((r["throughput"], r["full_load_throughput"], r["prefill_s"], r["wall_s"]))
        for rows, width, toks, drafted, el in trace:
            key = ("full" if rows == C else "fewer", "w1" if width == 1 else "wide", "drafted" if drafted else "-")
            a = agg[label][key]; a[0] += 1; a[1] += toks; a[2] += el
        print(f"rep{rep} {label:20s} tput {r['throughput']:.1f} full {r['full_load_throughput']:.1f}", flush=True)
print()
for label in labels:
    t = tput[label]
    print(f"{label:20s} tput {sum(x[0] for x in t)/len(t):6.1f} full {sum(x[1] for x in t)/len(t):6.1f} prefill {sum(x[2] for x in t)/len(t):5.2f} wall {sum(x[3] for x in t)/len(t):5.2f}")
    for key in sorted(agg[label]):
        n, toks, sec = agg[label][key]
        print(f"     {' '.join(key):22s} steps {n/reps:6.1f} tok/step {toks/n:5.2f} ms/step {1000*sec/n:6.1f} tok/s {toks/sec:6.1f}")
