import sys, re
log = open(sys.argv[1]).read().splitlines()
T = sys.argv[2]
recs = {}
order = []
for line in log:
    if not line.startswith(f"| {T} |"):
        continue
    c = [x.strip() for x in line.strip('|').split('|')]
    _, w, arm, tps, xplain, xbest, tau, rounds, ident = c
    if w not in recs:
        recs[w] = {}; order.append(w)
    recs[w][arm] = dict(tps=float(tps), tau=tau, rounds=rounds, ident=ident)
arms = ["prompt lookup", "plain, skinny linears", "prompt lookup, skinny linears", "lookup only", "DSpark only", "fused"]
hdr = f"| T = {T} | plain tok/s | " + " | ".join(arms) + " | fused ÷ max(plain, prompt lookup) | fused ÷ max(both, skinny linears) | fused ÷ lookup only | fused τ | fused rounds: lookup / drafter / plain |" + (" greedy identical |" if T == "0" else "")
print(hdr)
print("|" + "---|" * (hdr.count("|") - 1))
for w in order:
    r = recs[w]; p = r['plain']['tps']
    cells = [f"{r[a]['tps']/p:.2f}×" if a != "fused" else f"**{r[a]['tps']/p:.2f}×**" for a in arms]
    f = r['fused']['tps']
    line = f"| {w} | {p:.1f} | " + " | ".join(cells) + f" | {f/max(p, r['prompt lookup']['tps']):.2f} | {f/max(r['plain, skinny linears']['tps'], r['prompt lookup, skinny linears']['tps']):.2f} | {f/r['lookup only']['tps']:.2f} | {r['fused']['tau']} | {r['fused']['rounds']} |"
    if T == "0":
        line += " " + ("all" if all(r[a]['ident'] == 'yes' for a in r) else "NO") + " |"
    print(line)
