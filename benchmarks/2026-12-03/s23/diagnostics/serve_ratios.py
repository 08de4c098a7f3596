"""Per repeat: every policy's throughput ÷ none, and scheduled ÷ lookup-only (one serve-bench results.json)."""
import json, sys, collections, statistics
d = json.load(open(sys.argv[1]))
cells = collections.defaultdict(dict)
for r in d["results"]:
    cells[(r["concurrency"], r["repeat"])][r["policy"]] = r
for c in sorted({k[0] for k in cells}):
    ratios = []
    for (cc, rep), pol in sorted(cells.items()):
        if cc != c:
            continue
        none = pol["none"]["throughput"] if "none" in pol else pol["lookup-only"]["throughput"]
        line = " ".join(f"{p}={pol[p]['throughput']:.1f}({pol[p]['throughput']/none:.2f})" for p in pol)
        q = pol["scheduled"]["throughput"] / pol["lookup-only"]["throughput"]
        ratios.append(q)
        print(f"C={c:2d} #{rep}: {line} fused/lookup={q:.3f} agree={pol['scheduled'].get('greedy_agreement')}")
    print(f"C={c:2d} fused/lookup mean {statistics.mean(ratios):.3f} min {min(ratios):.3f} max {max(ratios):.3f}")
