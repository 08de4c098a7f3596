import sys, logging, torch
torch.set_num_threads(2)
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.serving import DSparkEngine
from hf_dspark.evaluation.serving_bench import AgentClosedLoop, agent_slots, run_interleaved
from hf_dspark.generation.memory import LONG_MATCH_TOKENS
from hf_dspark.generation import prefix_cache as pc
logging.basicConfig(level=logging.WARNING)
target, tok = load_target(None)
drafter = load_drafter(None, target).model
C = int(sys.argv[1]); pol = sys.argv[2]; entries = int(sys.argv[3]) if len(sys.argv) > 3 else 8
log = []
orig_take = pc.PrefixCacheStore.take
def take(self, key, prompt_ids, weights=()):
    had = key in self._entries
    r = orig_take(self, key, prompt_ids, weights)
    log.append((had, r is not None, len(prompt_ids), r[1] if r else 0))
    return r
pc.PrefixCacheStore.take = take
slots = agent_slots(tok, 2, max(drafter.config.block_size, LONG_MATCH_TOKENS))
eng = DSparkEngine(target, drafter if pol == "scheduled" else None, "scheduled", max_running_requests=C,
                   max_batch_tokens=C * slots, tokenizer=tok, **({} if pol == "scheduled" else {"lookup": True}))
eng._prefixes.max_entries = entries
_ = eng.step_cost
loop = AgentClosedLoop(eng, tok, C, 2, {})
r = run_interleaved([loop])[0]
m = eng.engine_metrics
print(f"{r['throughput']:.1f} tok/s prefill {r['prefill_s']:.1f}s wall {r['wall_s']:.1f}s prefill_tokens {m.prefill_tokens} reused {m.reused_prompt_tokens}")
print("lookups", len(log), "entry present", sum(h for h,_,_,_ in log), "hits", sum(x for _,x,_,_ in log))
print("missed prompt tokens (entry absent):", sum(n for h,x,n,_ in log if not h))
print("bytes now", eng._prefixes.num_bytes/2**20, "MiB entries", len(eng._prefixes))
