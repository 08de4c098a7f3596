import sys, logging, time, torch
torch.set_num_threads(2)
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.serving import DSparkEngine
from hf_dspark.serving import batch as B, engine as E
from hf_dspark.evaluation.serving_bench import AgentClosedLoop, agent_slots, run_interleaved
from hf_dspark.generation.memory import LONG_MATCH_TOKENS
logging.basicConfig(level=logging.WARNING)
eng_ref = []
orig_join = B.RunningBatch.join
def join(self, groups):
    e = eng_ref[0]
    v = sorted(self.vacant); n = sum(len(g.requests) for g in groups)
    widths = [g.mask.shape[1] for g in groups]
    r = orig_join(self, groups)
    if v or n:
        print(f"step {e.engine_metrics.steps}: vacant={len(v)} joiners={n} in_place={r} rows_after={len(self.requests)} slots={self.num_slots} joiner_widths={widths} waiting={len(e._waiting)} prefilling={[ (x.prefill.num_done, len(x.prefill.context)) for x in e._prefilling]}")
    return r
B.RunningBatch.join = join
target, tok = load_target(None)
drafter = load_drafter(None, target).model
C = int(sys.argv[1]); pol = sys.argv[2]
slots = agent_slots(tok, 2, max(drafter.config.block_size, LONG_MATCH_TOKENS))
eng = DSparkEngine(target, drafter if pol == "scheduled" else None, "scheduled", max_running_requests=C,
                   max_batch_tokens=C * slots, tokenizer=tok, **({} if pol == "scheduled" else {"lookup": True}))
eng_ref.append(eng)
print("slots", slots, "max_prefill_tokens", eng.max_prefill_tokens)
_ = eng.step_cost
loop = AgentClosedLoop(eng, tok, C, 2, {})
r = run_interleaved([loop])[0]
print(f"{pol}: {r['throughput']:.1f} tok/s wall {r['wall_s']:.1f}s")
