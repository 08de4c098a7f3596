"""A/B in one process, steps interleaved: the engine as committed against the same code with the old behaviour of
one change patched in for its steps only. Diagnostic only.
  python ab_engine.py C POLICY REPEATS drop    rows dropped in place + front room >= 128  vs  copy every kept row, 64
  python ab_engine.py C POLICY REPEATS gather  a finished row gathered into a growing buffer  vs  into exact-size tensors"""
import sys, logging, torch
torch.set_num_threads(2)
from hf_dspark.loading import load_drafter, load_target
from hf_dspark.serving import DSparkEngine
from hf_dspark.generation import kv_cache as kv, ragged_batch as rb
from hf_dspark.evaluation.serving_bench import AgentClosedLoop, agent_slots, run_interleaved, parse_policy
from hf_dspark.generation.memory import LONG_MATCH_TOKENS
logging.basicConfig(level=logging.WARNING)
target, tok = load_target(None)
drafter = load_drafter(None, target).model
C = int(sys.argv[1]); policy = sys.argv[2]; repeats = int(sys.argv[3]); change = sys.argv[4]
slots = agent_slots(tok, 2, max(drafter.config.block_size, LONG_MATCH_TOKENS))
new_drop, new_gather = rb.drop_rows_in_place, getattr(rb, "gathered_row_cache", None)  # gather: the reverted change
def exact_size_row(cache, row, slots, config):
    return kv.cache_from_tensors([(layer.keys[row:row + 1].index_select(2, slots),
                                   layer.values[row:row + 1].index_select(2, slots)) for layer in cache.layers], config)
def old_behaviour(step):
    def run():
        if change == "drop":
            kv.MIN_LEAD_SLOTS, rb.drop_rows_in_place = 64, (lambda *a: False)
        else:
            rb.gathered_row_cache = exact_size_row
        try:
            return step()
        finally:
            kv.MIN_LEAD_SLOTS, rb.drop_rows_in_place, rb.gathered_row_cache = 128, new_drop, new_gather
    return run
def engine():
    name, kwargs, engine_kwargs = parse_policy(policy, None)
    draft = engine_kwargs.pop("draft", drafter if name != "none" else None)
    e = DSparkEngine(target, draft, name, policy_kwargs=kwargs, max_running_requests=C, max_batch_tokens=C * slots,
                     tokenizer=tok, **engine_kwargs)
    if e.policy.needs_step_cost:
        _ = e.step_cost
    return e
ratios = []
for r in range(repeats):
    new, old = engine(), engine()
    old.step = old_behaviour(old.step)
    loops = {"new": AgentClosedLoop(new, tok, C, 2, {}), "old": AgentClosedLoop(old, tok, C, 2, {})}
    order = ["new", "old"] if r % 2 == 0 else ["old", "new"]
    recs = dict(zip(order, run_interleaved([loops[k] for k in order])))
    agree = recs["new"]["outputs"] == recs["old"]["outputs"]
    ratios.append(recs["new"]["throughput"] / recs["old"]["throughput"])
    print(f"{change} C={C} {policy} #{r}: new {recs['new']['throughput']:.1f} tok/s, old {recs['old']['throughput']:.1f} tok/s, "
          f"new/old {ratios[-1]:.3f}, outputs equal {agree}", flush=True)
print(f"{change} C={C} {policy} new/old mean {sum(ratios)/len(ratios):.3f} min {min(ratios):.3f} max {max(ratios):.3f}")
