"""Mix target caches without copying them: a new cache directory whose manifest lists the shards of several
caches (symlinked, side-cars included), each repeated --repeat times (a cheap mixing weight).

The caches must come from the same target, tapped layers, template, max length and storage dtype (the keys a cache
extension checks). Training then reads the mix like any cache (scripts/train_drafter.py --cache <out>).

    python scripts/mix_target_caches.py --caches runs/cache/onpolicy runs/cache/human --repeat 2 1 \\
        --out runs/cache/mix
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from hf_dspark.training.target_cache import LOGSUMEXP_SUFFIX, MANIFEST_NAME, load_manifest

_SAME = ("target_model_type", "target_layer_ids", "hidden_size", "num_target_layers", "vocab_size",
         "chat_template_sha256", "max_length", "dtype")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--caches", nargs="+", required=True)
    p.add_argument("--repeat", type=int, nargs="+", default=None, help="times each cache's shards are listed")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    repeat = args.repeat or [1] * len(args.caches)
    if len(repeat) != len(args.caches):
        raise SystemExit("--repeat needs one count per cache")
    manifests = [load_manifest(c) for c in args.caches]
    for key in _SAME:
        values = {json.dumps(m.get(key)) for m in manifests}
        if len(values) > 1:
            raise SystemExit(f"the caches differ in {key}: {sorted(values)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("shard-*"):
        old.unlink()
    mix = {**manifests[0], "shards": [], "num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0,
           "mixed_from": [{"cache": str(Path(c).resolve()), "repeat": r} for c, r in zip(args.caches, repeat)]}
    for cache, manifest, times in zip(args.caches, manifests, repeat):
        for _ in range(times):
            for shard in manifest["shards"]:
                name = f"shard-{len(mix['shards']):05d}.safetensors"
                source = Path(cache).resolve() / shard["file"]
                os.symlink(source, out / name)
                lse = source.with_name(source.name.removesuffix(".safetensors") + LOGSUMEXP_SUFFIX)
                if lse.is_file():
                    os.symlink(lse, out / (name.removesuffix(".safetensors") + LOGSUMEXP_SUFFIX))
                mix["shards"].append({**shard, "file": name})
                for key in ("num_samples", "num_tokens", "num_loss_tokens"):
                    mix[key] += shard[key]
    (out / MANIFEST_NAME).write_text(json.dumps(mix, indent=2))
    print(f"{out}: {mix['num_samples']} samples, {mix['num_tokens']} tokens ({mix['num_loss_tokens']} loss tokens) "
          f"from {len(args.caches)} caches")


if __name__ == "__main__":
    main()
