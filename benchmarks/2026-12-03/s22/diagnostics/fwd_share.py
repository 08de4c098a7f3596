import time, sys, logging, torch
torch.set_num_threads(2)
sys.path.insert(0, "/work/main/scripts")
from bench_fusion import render
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.generation import speculative_round as sr
logging.basicConfig(level=logging.WARNING)
target, tok = load_target(None)
drafter = load_drafter(None, target).model
F = []; R = []
orig_fwd = type(target).forward
def fwd(self, *a, **k):
    t = time.perf_counter(); out = orig_fwd(self, *a, **k); F.append((k.get("input_ids").shape, time.perf_counter() - t)); return out
type(target).forward = fwd
orig_run = sr.SpeculativeRound.run
def run(self, *a, **k):
    n = len(F); t = time.perf_counter(); res = orig_run(self, *a, **k); R.append((time.perf_counter() - t, sum(x[1] for x in F[n:]), res.width, res.block is not None)); return res
sr.SpeculativeRound.run = run
ids = render(tok, [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}])
for arm, kw in [("lookup-only", {"dspark_lookup": "only"}), ("fused", {}), ("plain-hf", None)]:
    F.clear(); R.clear()
    t = time.perf_counter()
    if kw is None:
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id)
    else:
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False, assistant_model=drafter, pad_token_id=tok.pad_token_id, **kw)
    s = time.perf_counter() - t
    dec = [x for x in F if x[0][1] <= 17]
    print(arm, f"{s:.2f}s", "forwards", len(F), "decode fwd median ms", round(1000*sorted(d[1] for d in dec)[len(dec)//2], 1) if dec else None,
          "rounds", len(R), "round median ms", round(1000*sorted(r[0] for r in R)[len(R)//2], 1) if R else None,
          "fwd share in rounds", round(sum(r[1] for r in R)/max(sum(r[0] for r in R), 1e-9), 2) if R else None)
