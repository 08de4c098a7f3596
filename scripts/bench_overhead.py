"""Host overhead of one speculative round: hf-dspark vs transformers' own DFlash and assisted-decoding loops, on tiny
random targets under an oracle that fixes acceptance (``hf_dspark.evaluation.round_overhead``, which documents the
implementations, variants and columns; ``--help`` lists the options).

    python scripts/bench_overhead.py --quick --out /tmp/bo                    # CI smoke, seconds
    python scripts/bench_overhead.py --models qwen3 --accept 4of7 --tokens 256 2048 --batch 1 8 --variants plain \\
        --impls dflash dspark-dflash dspark --repeats 9 --out runs/bench_overhead
"""

from hf_dspark.evaluation.round_overhead import main

if __name__ == "__main__":
    main()
