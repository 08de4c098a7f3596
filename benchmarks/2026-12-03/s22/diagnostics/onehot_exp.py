import sys, logging, torch
torch.set_num_threads(2)
sys.path.insert(0, "/work/main/scripts")
from bench_fusion import render, CATEGORIES, HELDOUT_DIR, read_heldout
from hf_dspark.evaluation.benchmarks import default_eval_dir
from hf_dspark.training.prompts import read_prompts
from hf_dspark.loading import load_drafter, load_target
import hf_dspark.generation.generate as G
logging.basicConfig(level=logging.WARNING)
S = {"s": [[] for _ in range(4)], "g": [[] for _ in range(4)], "match": [[] for _ in range(4)]}
orig = G.verify
def verify(drafts, lengths, target_logits, probs, **kw):
    if probs is not None:
        p = torch.softmax(target_logits.float(), -1)
        for j in range(min(4, probs.shape[1])):
            q = probs[:, j]; pj = p[:, j]
            S["s"][j].append(float(torch.minimum(pj, q).sum(-1).mean()))
            S["g"][j].append(float(pj.gather(-1, q.argmax(-1, keepdim=True)).mean()))
            S["match"][j].append(float((q.argmax(-1) == pj.argmax(-1)).float().mean()))
    return orig(drafts, lengths, target_logits, probs, **kw)
G.verify = verify
target, tok = load_target(None)
drafter = load_drafter(None, target).model
prompts = [p.turns[0] for c in CATEGORIES for p in read_prompts(default_eval_dir() / f"{c}.jsonl")[:2]]
prompts += [p.text for p in read_heldout(HELDOUT_DIR / "chat.jsonl")[:2]]
T = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
for text in prompts:
    ids = render(tok, [{"role": "user", "content": text}])
    target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=True, temperature=T,
                    assistant_model=drafter, pad_token_id=tok.pad_token_id, dspark_num_tokens=4, dspark_lookup=False)
import numpy as np
for j in range(4):
    print(f"T={T} pos {j+1}: n={len(S['s'][j])} sampled-q acceptance {np.mean(S['s'][j]):.3f}  one-hot(argmax q) {np.mean(S['g'][j]):.3f}  argmax match {np.mean(S['match'][j]):.3f}")
