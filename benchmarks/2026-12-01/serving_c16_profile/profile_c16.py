import cProfile, pstats, sys, time, torch, logging
torch.set_num_threads(2)
from hf_dspark.loading import load_target, load_drafter
from hf_dspark.evaluation.serving_bench import serving_prompts, parse_policy, run_level
from hf_dspark.serving import DSparkEngine
from hf_dspark.generation.memory import LONG_MATCH_TOKENS
target, tok = load_target()
drafter = load_drafter(None, target).model
prompts = serving_prompts(tok, None, 4, None, 512)
C = int(sys.argv[1]) if len(sys.argv) > 1 else 16
labels = sys.argv[2].split(",") if len(sys.argv) > 2 else ["none", "scheduled-nolookup", "lookup-only"]
prof = "--prof" in sys.argv
slots = max(len(i) for _, i in prompts) + 64 + max(drafter.config.block_size, LONG_MATCH_TOKENS) + 1
for rep in range(2):
  for label in labels:
    name, kw, ekw = parse_policy(label, 0.5)
    draft = ekw.pop("draft", drafter if name != "none" else None)
    eng = DSparkEngine(target, draft, name, policy_kwargs=kw, max_running_requests=C, max_batch_tokens=C*slots,
                       max_prefill_tokens=2048, tokenizer=tok, **ekw)
    if eng.policy.needs_step_cost: _ = eng.step_cost
    p = cProfile.Profile() if (prof and rep == 1) else None
    if p: p.enable()
    r = run_level(eng, prompts, C, 2*C, 64, {})
    if p:
        p.disable(); pstats.Stats(p).sort_stats("cumulative").print_stats(45); pstats.Stats(p).sort_stats("cumulative").print_stats("flush_context|defer_context|extend_context|features|compact|join|_choose|_plan|_observe|commit|observe_step|wants_drafts|verification.py|proposals.py")
    m = eng.metrics()
    print(f"rep{rep} {label:20s} tput {r['throughput']:.1f} steps {r['decode_steps']} skipped {r['skipped_draft_steps']} draft_s {r['draft_s']:.2f} verify_s {r['verify_s']:.2f} prefill_s {r['prefill_s']:.2f} wall {r['wall_s']:.2f} tau {r['tau']:.2f}", flush=True)
