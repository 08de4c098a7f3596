import sys, logging, time, torch, functools, collections
torch.set_num_threads(2)
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.serving import DSparkEngine
from hf_dspark.serving import batch as B, engine as E
from hf_dspark.generation import ragged_batch as RB
from hf_dspark.modeling import modeling as M, draft_cache as DC
from hf_dspark.evaluation.serving_bench import AgentClosedLoop, agent_slots, run_interleaved
from hf_dspark.generation.memory import LONG_MATCH_TOKENS
logging.basicConfig(level=logging.WARNING)
T = collections.Counter(); N = collections.Counter()
depth = [0]
def wrap(cls, name, label):
    f = getattr(cls, name)
    @functools.wraps(f)
    def g(*a, **k):
        s = time.perf_counter()
        try: return f(*a, **k)
        finally: T[label] += time.perf_counter() - s; N[label] += 1
    setattr(cls, name, g)
wrap(B.RunningBatch, "join", "join")
wrap(B.RunningBatch, "drop_vacant", "join.drop_vacant")
wrap(B.RunningBatch, "_fill_vacant", "join.fill_vacant")
wrap(RB.RaggedBatch, "flush_context", "flush_context")
wrap(RB.RaggedBatch, "row_caches", "retire.row_caches")
wrap(E.DSparkEngine, "_retire", "retire")
wrap(E.DSparkEngine, "_keep_prefix", "retire.keep_prefix")
wrap(E.DSparkEngine, "_prefill", "prefill")
wrap(E.DSparkEngine, "_decode_isolating_faults", "decode")
wrap(E.DSparkEngine, "step", "step")
wrap(E.DSparkEngine, "_admit", "admit")
wrap(DC.DraftCache, "select_rows", "dc.select_rows"); wrap(DC.DraftCache, "_reserve", "dc._reserve"); wrap(DC.DraftCache, "replace_row", "dc.replace_row"); wrap(DC.DraftCache, "row", "dc.row"); wrap(DC.DraftCache, "append", "dc.append"); wrap(RB, "stack_draft_rows", "stack_draft_rows"); wrap(RB, "stack_rows", "stack_rows"); wrap(B, "stack_draft_rows", "B.stack_draft_rows"); wrap(B, "stack_rows", "B.stack_rows")

target, tok = load_target(None)
drafter = load_drafter(None, target).model
wrap(type(drafter), "extend_context", "extend_context")
C = int(sys.argv[1]); pol = sys.argv[2]
slots = agent_slots(tok, 2, max(drafter.config.block_size, LONG_MATCH_TOKENS))
eng = DSparkEngine(target, drafter if pol == "scheduled" else None, "scheduled", max_running_requests=C,
                   max_batch_tokens=C * slots, tokenizer=tok, **({} if pol == "scheduled" else {"lookup": True}))
_ = eng.step_cost
T.clear(); N.clear()
loop = AgentClosedLoop(eng, tok, C, 2, {})
r = run_interleaved([loop])[0]
m = eng.engine_metrics
print(f"{pol}: {r['throughput']:.1f} tok/s wall {r['wall_s']:.1f}s prefill_tokens {m.prefill_tokens}")
for k in sorted(T): print(f"  {k:22s} {T[k]:7.2f}s n={N[k]}")
print("  step - prefill - decode - retire(in step?)", T['step'] - T['prefill'] - T['decode'])
