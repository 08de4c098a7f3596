"""How much of what the drafter projects is committed context: valid slots / projected slots per extend_context."""
import sys, logging, time, torch
torch.set_num_threads(2)
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.serving import DSparkEngine
from hf_dspark.evaluation.serving_bench import AgentClosedLoop, agent_slots, run_interleaved
from hf_dspark.generation.memory import LONG_MATCH_TOKENS
from hf_dspark.modeling import modeling
logging.basicConfig(level=logging.WARNING)
S = {"calls": 0, "slots": 0, "valid": 0, "secs": 0.0}
orig = modeling.DSparkDraftModel.extend_context
def ext(self, cache, features, positions, valid=None, *a, **k):
    S["calls"] += 1; S["slots"] += positions.numel(); S["valid"] += int(valid.sum()) if valid is not None else positions.numel()
    t = time.perf_counter(); out = orig(self, cache, features, positions, valid, *a, **k); S["secs"] += time.perf_counter() - t
    return out
modeling.DSparkDraftModel.extend_context = ext
target, tok = load_target(None)
drafter = load_drafter(None, target).model
C = int(sys.argv[1])
slots = agent_slots(tok, 2, max(drafter.config.block_size, LONG_MATCH_TOKENS))
eng = DSparkEngine(target, drafter, "scheduled", max_running_requests=C, max_batch_tokens=C * slots, tokenizer=tok)
_ = eng.step_cost
r = run_interleaved([AgentClosedLoop(eng, tok, C, 2, {})])[0]
print(f"{r['throughput']:.1f} tok/s wall {r['wall_s']:.1f}s; extend_context {S}, valid fraction {S['valid']/S['slots']:.2f}")
