import json, sys, collections, statistics
L = json.load(open(sys.argv[1]))
stats = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
for i, r in enumerate(L):
    src = set(r["src"])
    if r["drafted"]:
        k = "learn" if r["learning"] else ("bet" if (r["gain"] or 0) > 1.0 else "probe")
    else:
        k = "lookup" if r["width"] > 1 else "plain"
    s = stats[k]; s[0] += 1; s[1] += r["secs"]; s[2] += r["tokens"]; s[3] += r["secs"] / (r["plain_pred"] * (r["rho"] or 1))
    if r["drafted"]:
        print(f'{i:3d} {k:5s} rows={r["rows"]:2d} w={r["width"]} tok={r["tokens"]:2d} tot={1000*r["secs"]:.0f} d={1000*r["dsecs"]:.0f} flush={1000*r["flush"]:.0f} pred={1000*r["pred"]:.0f} plain_pred={1000*r["plain_pred"]:.0f} rho={r["rho"] and round(r["rho"],2)} kappa={r["kappa"]:.2f} n_k={r["n"]} gain={r["gain"] and round(r["gain"],2)} srcs={collections.Counter(r["src"])}')
for k, (n, t, tok, rel) in stats.items():
    print(f"{k:6s} n={n:3d} {1000*t/n:.0f} ms/step {tok/n:.2f} tok/step {tok/t:.1f} tok/s  step/plain-priced {rel/n:.2f}")
