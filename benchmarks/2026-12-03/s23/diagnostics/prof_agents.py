import sys, logging, torch, cProfile, pstats
torch.set_num_threads(2)
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.serving import DSparkEngine
from hf_dspark.evaluation.serving_bench import AgentClosedLoop, agent_slots, run_interleaved
from hf_dspark.generation.memory import LONG_MATCH_TOKENS
logging.basicConfig(level=logging.WARNING)
target, tok = load_target(None)
drafter = load_drafter(None, target).model
C = int(sys.argv[1]); pol = sys.argv[2]
slots = agent_slots(tok, 2, max(drafter.config.block_size, LONG_MATCH_TOKENS))
eng = DSparkEngine(target, drafter if pol == "scheduled" else None, "scheduled", max_running_requests=C,
                   max_batch_tokens=C * slots, tokenizer=tok, **({} if pol == "scheduled" else {"lookup": True}))
_ = eng.step_cost
loop = AgentClosedLoop(eng, tok, C, 2, {})
pr = cProfile.Profile(); pr.enable()
r = run_interleaved([loop])[0]
pr.disable()
m = eng.engine_metrics
print(f"{r['throughput']:.1f} tok/s prefill {r['prefill_s']:.1f}s wall {r['wall_s']:.1f}s prefill_tokens {m.prefill_tokens} reused {m.reused_prompt_tokens} forwards {m.prefill_forwards}")
st = pstats.Stats(pr).sort_stats("cumulative"); st.print_stats(45); st.print_stats("draft|extend_context|flush|tap|features|modeling.py|drafting", 40)
