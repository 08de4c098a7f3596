import sys, time, logging, torch, numpy as np
torch.set_num_threads(2)
sys.path.insert(0, "/work/main/scripts")
from bench_fusion import render, HELDOUT_DIR, read_heldout
from hf_dspark.generation.memory import memory_for
from hf_dspark.loading import load_drafter, load_target
logging.basicConfig(level=logging.WARNING)
np.set_printoptions(precision=2, suppress=True)
target, tok = load_target(None)
drafter = load_drafter(None, target).model
ARMS = {"lookup": {"dspark_lookup": "only", "dspark_lookup_scope": "lookup"}, "dspark": {"dspark_lookup": False},
        "fused": {"dspark_lookup_scope": "fused"}}
arms = sys.argv[1].split(",")
for i, p in enumerate(read_heldout(HELDOUT_DIR / "chat.jsonl")[:4]):
    ids = render(tok, [{"role": "user", "content": p.text}])
    for arm in arms:
        t = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=96, do_sample=False,
                              assistant_model=drafter, pad_token_id=tok.pad_token_id, **ARMS[arm])
        s = time.perf_counter() - t
        if arm == "dspark":
            pol = memory_for(target).policy_for(drafter, False)
            print(f"chat/{i} {arm:7s} {s:.2f}s {dict((k, v.rounds) for k, v in drafter.stats.by_source.items())} surv={pol.mean_survival[:4]} best={pol._best_survival[:4] if pol._best_survival is not None else None} n={pol._survival_rounds} probe_every={pol._probe_every} skipped={pol._skipped_in_a_row} rho={ {k: round(v,2) for k,v in pol.plain_step_ratios.items()} } k={ {k: round(v,2) for k,v in pol.step_time_ratios_at(1).items() if 'sampled' not in k} }", flush=True)
