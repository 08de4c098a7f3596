"""Why joins stack instead of filling a vacant row in place (C agents, lookup only or fused)."""
import sys, logging, collections, time, torch
torch.set_num_threads(2)
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.serving import DSparkEngine, batch as bm
from hf_dspark.evaluation.serving_bench import AgentClosedLoop, agent_slots, run_interleaved
from hf_dspark.generation.memory import LONG_MATCH_TOKENS
logging.basicConfig(level=logging.WARNING)
R = collections.Counter(); W = []
orig_fill = bm.RunningBatch._fill_vacant
def fill(self, groups):
    width = self.num_slots
    for g in groups:
        for i in range(len(g.requests)):
            if g.mask.shape[1] > width:
                R["wider"] += 1; W.append(g.mask.shape[1] - width)
    return orig_fill(self, groups)
bm.RunningBatch._fill_vacant = fill
orig_join = bm.RunningBatch.join
def join(self, groups):
    n = sum(len(g.requests) for g in groups)
    vac = len(self.vacant)
    t = time.perf_counter(); placed = orig_join(self, groups); dt = time.perf_counter() - t
    R["joining"] += n; R["in_place"] += placed; R["vacant_at_join"] += vac
    if n and placed < n: R["stacked"] += n - placed; R["stack_s"] += dt
    return placed
bm.RunningBatch.join = join
target, tok = load_target(None)
drafter = load_drafter(None, target).model
C = int(sys.argv[1]); fused = sys.argv[2] == "fused"
slots = agent_slots(tok, 2, max(drafter.config.block_size, LONG_MATCH_TOKENS))
eng = DSparkEngine(target, drafter if fused else None, "scheduled", max_running_requests=C, max_batch_tokens=C * slots, tokenizer=tok)
_ = eng.step_cost
r = run_interleaved([AgentClosedLoop(eng, tok, C, 2, {})])[0]
print(f"{r['throughput']:.1f} tok/s wall {r['wall_s']:.1f}s; {dict(R)}; widening {sorted(W)}")
