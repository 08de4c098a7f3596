import json, collections, numpy as np
L = json.load(open("/tmp/ab/diag_t1.json"))
by = collections.OrderedDict()
for r in L: by.setdefault(r["arm"], []).append(r)
for arm, rs in by.items():
    kinds = collections.Counter()
    stats = collections.defaultdict(lambda: [0, 0.0, 0])
    for r in rs:
        if r["drafted"]:
            g = r["gain"]; k = "learn" if r["learning"] else ("bet" if g is not None and g > 1.0 else f"probe/other")
        else:
            k = r["src"] if r["width"] > 1 else "plain"
        s = stats[k]; s[0] += 1; s[1] += r["secs"]; s[2] += r["tokens"]
    line = "  ".join(f"{k}:{n} {1000*t/n:.0f}ms {tok/n:.2f}t ({tok/t:.1f}t/s)" for k, (n, t, tok) in stats.items())
    print(f"{arm:28s} {line}")
    d = [r for r in rs if r["drafted"]]
    if d and "fused" in arm:
        print("     gains:", [None if r["gain"] is None else round(r["gain"], 2) for r in d][:20], "surv", d[-1]["surv"], d[-1]["k"], "n", d[-1]["n"])
