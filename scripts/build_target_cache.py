"""Build (or extend) a target cache: tapped-layer outputs + final hidden states of regenerated conversations.

Resumable: rerun the same command and it skips conversations already cached. Defaults fit a CPU and the
embedded SmolLM2-135M-Instruct target. Usage:

    python scripts/build_target_cache.py --data data/smollm2/train.jsonl --out cache/smollm2
    python scripts/build_target_cache.py --target path/to/model --data a.jsonl b.jsonl --out cache/x --layers 1 9 17
"""

from __future__ import annotations

import argparse
import itertools
import logging

import torch

from hf_dspark.training.target_cache import (MIN_LOSS_TOKENS, STORAGE_DTYPES, build_target_cache, read_jsonl,
                                             target_logits_function, write_target_logsumexp)
from hf_dspark.embedded import load_target

logger = logging.getLogger("build_target_cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True, help="jsonl files of {'id', 'messages': [...]} records")
    parser.add_argument("--out", required=True, help="cache directory (created, or extended when it exists)")
    parser.add_argument("--target", default=None, help="target model path / id (default: embedded SmolLM2)")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="0-based target layers to tap (default: DSparkConfig's spread of 5)")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(STORAGE_DTYPES), help="storage dtype")
    parser.add_argument("--min-loss-tokens", type=int, default=MIN_LOSS_TOKENS)
    parser.add_argument("--shard-size-mb", type=int, default=512)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N records (smoke tests)")
    parser.add_argument("--logsumexp", action="store_true",
                        help="also store the target's per-token log-normaliser (reduced-vocabulary training)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    target, tokenizer = load_target(args.target)
    target.to(args.device)
    records = itertools.chain.from_iterable(read_jsonl(path) for path in args.data)
    if args.limit is not None:
        records = itertools.islice(records, args.limit)
    manifest = build_target_cache(target, tokenizer, records, args.out, layer_ids=args.layers,
                                  max_length=args.max_length, batch_size=args.batch_size, dtype=args.dtype,
                                  min_loss_tokens=args.min_loss_tokens, shard_size_mb=args.shard_size_mb)
    if args.logsumexp:
        compute_logits, head_dtype = target_logits_function(target)
        write_target_logsumexp(args.out, compute_logits, head_dtype)
    logger.info("Cache %s: %d samples, %d tokens (%d loss tokens), layers %s", args.out, manifest["num_samples"],
                 manifest["num_tokens"], manifest["num_loss_tokens"], manifest["target_layer_ids"])


if __name__ == "__main__":
    main()
