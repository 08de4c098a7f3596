"""Fused vs lookup-only at T=1, interleaved per prompt: every fused round's decision and time."""
import sys, time, logging, json
sys.path.insert(0, "/work/main/scripts")
import torch, numpy as np
torch.set_num_threads(2)
from bench_fusion import render, CATEGORIES
from hf_dspark.generation import speculative_round as sr
from hf_dspark.scheduling import policies as pol
from hf_dspark.evaluation.benchmarks import default_eval_dir
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.training.prompts import read_prompts
logging.basicConfig(level=logging.WARNING)
LOG = []; ARM = ["?"]; FL = [0.0]
from hf_dspark.generation import ragged_batch as rbm
_ofb = rbm.RaggedBatch.flush_backlog
def fb(self, d):
    t = time.perf_counter(); _ofb(self, d); FL[0] = time.perf_counter() - t
rbm.RaggedBatch.flush_backlog = fb
orig_run = sr.SpeculativeRound.run
def run(self, batch, processor, budgets, **kw):
    p = self.policy
    rb = getattr(p, "_survival_rounds", 0)
    FL[0] = 0.0
    t = time.perf_counter()
    res = orig_run(self, batch, processor, budgets, **kw)
    dt = time.perf_counter() - t
    c = self.cost if getattr(p, "needs_step_cost", False) else None
    pred = None if c is None else ((c.draft(1) if res.block is not None else 0.0) + c.verify(1, res.width))
    LOG.append(dict(arm=ARM[0], dsecs=res.draft_seconds, vsecs=res.verify_seconds, flush=FL[0], pred=pred,
                    rho=dict(getattr(p, "_plain_ratio", {})).get((1, True)), drafted=res.block is not None, width=res.width, tokens=len(res.tokens[0]), secs=dt,
                    gain=getattr(p, "last_drafter_gain", None), learning=rb < 4, src=str(res.sources[0]) if res.sources else None,
                    n=rb, surv=None if getattr(p, "mean_survival", None) is None else [round(x, 3) for x in p.mean_survival[:6]],
                    k={k: round(v, 2) for k, v in p.step_time_ratios_at(1).items() if "sampled" in k} if hasattr(p, "step_time_ratios_at") else None))
    return res
sr.SpeculativeRound.run = run
target, tok = load_target(None)
drafter = load_drafter(None, target).model
cats = sys.argv[1].split(",") if len(sys.argv) > 1 else CATEGORIES[:5]
arms = {"lookup only": {"dspark_lookup": "only", "dspark_lookup_scope": "lookup"},
        "fused": {"dspark_lookup_scope": "fused"}}
for cat in cats:
    for i, p in enumerate(read_prompts(default_eval_dir() / f"{cat}.jsonl")[:2]):
        ids = render(tok, [{"role": "user", "content": p.turns[0]}])
        for arm, kw in arms.items():
            ARM[0] = f"{cat}/{i}/{arm}"
            torch.manual_seed(0)
            t = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=96, do_sample=True,
                                  temperature=1.0, assistant_model=drafter, pad_token_id=tok.pad_token_id, **kw)
            s = time.perf_counter() - t
            print(f"{ARM[0]:30s} {out.shape[1]-ids.shape[1]:3d} tok {s:5.2f}s {(out.shape[1]-ids.shape[1])/s:5.1f} tok/s", flush=True)
json.dump(LOG, open("/tmp/ab/diag_t1.json", "w"))
