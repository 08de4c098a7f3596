import time, sys, statistics, torch
torch.set_num_threads(2)
import hf_dspark
target, tok = hf_dspark.load_default_target()
draft = hf_dspark.load_default_drafter(target)
msgs = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]
ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
arms = {"plain": {}, "fused": {"assistant_model": draft}, "no proposals": {"assistant_model": draft, "dspark_policy": "none", "dspark_lookup": False}}
for name, kw in arms.items():
    target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=True, temperature=1.0, **kw)
res = {k: [] for k in arms}
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for rep in range(reps):
    for name, kw in (list(arms.items())[rep % 3:] + list(arms.items())[:rep % 3]):
        torch.manual_seed(rep)
        t = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=96, min_new_tokens=96, do_sample=True, temperature=1.0, pad_token_id=tok.pad_token_id, **kw)
        el = time.perf_counter() - t
        res[name].append((out.shape[1] - ids.shape[1]) / el)
for k, v in res.items(): print(k, round(statistics.median(v), 2), [round(x, 2) for x in v])
