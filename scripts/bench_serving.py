"""Serving benchmark (paper Figs. 7-8): DSparkEngine throughput vs per-user speed under closed-loop load.

For each concurrency C, every policy serves the same request stream with C requests always in flight (a finished
request is replaced at once): engine throughput (generated tok/s over the run), per-user tok/s (each request's
decoding speed after its first token, averaged), TTFT, mean verify budget (drafts verified per request per
step), τ and wasted verify tokens. Policies are interleaved within each concurrency level so the noise of a
shared machine hits them alike. Target: the embedded SmolLM2-135M-Instruct; drafter: the packaged default
drafter, else ``--drafter PATH``, else an UNTRAINED one (then the numbers show overhead only, and say so).

Smoke (< 2 min):
    python scripts/bench_serving.py --concurrency 1,2 --max-prompts 2 --max-new-tokens 16 --min-requests 2 \
        --requests-factor 1 --out runs/bench_serving_smoke
Full:
    python scripts/bench_serving.py --out runs/bench_serving

This script is ``hf-dspark serve-bench`` (same options, ``--help`` lists them); the work is done in the package.
"""

from __future__ import annotations

import sys

from hf_dspark.cli import main as hf_dspark_main


def main(argv: list[str] | None = None) -> int:
    return hf_dspark_main(["serve-bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
