"""Engine agents: every round of the fused engine with its pricing state."""
import sys, time, json, logging
import torch
torch.set_num_threads(2)
from hf_dspark.generation import speculative_round as sr
from hf_dspark.generation import ragged_batch as rbm
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.serving import DSparkEngine
from hf_dspark.evaluation.serving_bench import AgentClosedLoop, agent_slots, run_interleaved
from hf_dspark.generation.memory import LONG_MATCH_TOKENS
logging.basicConfig(level=logging.WARNING)
LOG = []; FL = [0.0]
_ofb = rbm.RaggedBatch.flush_backlog
def fb(self, d):
    t = time.perf_counter(); _ofb(self, d); FL[0] = time.perf_counter() - t
rbm.RaggedBatch.flush_backlog = fb
orig_run = sr.SpeculativeRound.run
def run(self, batch, processor, budgets, **kw):
    p = self.policy; rows = len(budgets)
    rb = getattr(p, "_survival_rows", 0)
    kd = (True, True, False, rows)
    before = dict(n=p._time_count.get(kd, 0), kappa=p.step_time_ratio(wide=True, drafted=True, rows=rows),
                  rho=p._plain_ratio.get((rows, False)), skipped=p._skipped_in_a_row)
    FL[0] = 0.0
    t = time.perf_counter()
    res = orig_run(self, batch, processor, budgets, **kw)
    dt = time.perf_counter() - t
    c = self.cost
    pred = (c.draft(rows) if res.block is not None else 0.0) + c.verify(rows, res.width)
    LOG.append(dict(rows=rows, drafted=res.block is not None, width=res.width, tokens=sum(map(len, res.tokens)),
                    secs=dt, dsecs=res.draft_seconds, flush=FL[0], pred=pred, plain_pred=c.verify(rows, 1),
                    gain=p.last_drafter_gain, learning=rb < p.min_learning_rows, src=[str(s) for s in res.sources], **before))
    return res
sr.SpeculativeRound.run = run
target, tok = load_target(None)
drafter = load_drafter(None, target).model
C = int(sys.argv[1])
slots = agent_slots(tok, 2, max(drafter.config.block_size, LONG_MATCH_TOKENS))
eng = DSparkEngine(target, drafter, "scheduled", max_running_requests=C, max_batch_tokens=C * slots, tokenizer=tok)
_ = eng.step_cost
loop = AgentClosedLoop(eng, tok, C, 2, {})
r = run_interleaved([loop])[0]
print(f"{r['throughput']:.1f} tok/s wall {r['wall_s']:.1f}s")
json.dump(LOG, open(f"/tmp/ab/diag_eng{C}.json", "w"))
