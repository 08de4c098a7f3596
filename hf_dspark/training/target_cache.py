"""Target cache: tapped target-layer outputs and final hidden states of the training conversations, on disk.

Why a cache: a training step needs, for every token of a conversation, the concatenated raw outputs of the
tapped target layers (the drafter's context features) and the target's final post-norm hidden state (from
which the frozen LM head recomputes the target distribution at sampled positions). Running the target once
per conversation instead of once per step per epoch is the cheap part of training on a CPU.

Layout of a cache directory::

    manifest.json                       target identity, layer ids, template hash, max length, shard list
    shard-00000.safetensors             one shard = many samples, concatenated along tokens:
        input_ids [n_tok] int32, loss_mask [n_tok] uint8, offsets [n_samples + 1] int64,
        target_hidden_states [n_tok, m·d], target_last_hidden_states [n_tok, d]   (bf16 or fp16)
        metadata {"ids": JSON list of sample ids}
    shard-00000.lse.safetensors         optional side-car: target_logsumexp [n_tok] fp32, log Σ_v exp(logit_v) of
                                        the target at every token (see :func:`write_target_logsumexp`)

Writes are resumable: samples whose id is already in a shard are skipped, each new shard is written to a
temporary name and renamed, then the manifest is rewritten atomically; a crash loses at most one shard.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import logging
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ..modeling.configuration import default_target_layer_ids
from ..modeling.families import soft_cap_logits
from ..modeling.target_compatibility import embedding_signature
from ..modeling.target_taps import TargetFeatureTap

logger = logging.getLogger(__name__)


class TargetCacheError(ValueError):
    """A target cache that cannot be extended or trained on as asked (another target or other settings, a format
    this version cannot read, no conversations): the message says which and what to do instead."""

CACHE_FORMAT = "hf_dspark.target_cache"
CACHE_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MIN_LOSS_TOKENS = 14  # DeepSpec's min_loss_tokens: shorter responses teach too few blocks to be worth a sample
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SIGNATURE_RTOL = 2e-2


# ---------------------------------------------------------------------------------------------------------
# Tokenisation and loss mask
# ---------------------------------------------------------------------------------------------------------
@dataclass
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant content through the end-of-turn marker

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages: list[dict], truncated: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of every assistant turn (content + end-of-turn).

    Template-agnostic: turn i's span starts where the rendering of messages[:i] with the generation prompt
    ends (what the target sees at inference) and ends where the rendering of messages[:i + 1] ends, so the
    end-of-turn marker of any template (ChatML's "<|im_end|>\\n") is included. Templates whose rendering of a
    prefix is not a prefix of the whole (e.g. ones that rewrite earlier turns) fall back to locating the
    content itself. ``truncated``: the last turn was cut at max_new_tokens, so its end-of-turn marker was
    never produced by the target and is left out of the span.
    """
    text = _render(tokenizer, messages)
    spans, cursor = [], 0
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        head = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
        content = message["content"]
        if text.startswith(head) and text.startswith(through) and len(through) > len(head) >= cursor:
            start, end = len(head), len(through)
        else:
            found = text.find(content, cursor)
            if found < 0:
                logger.warning("Cannot locate assistant turn %d in the rendered conversation; it is not trained on", i)
                continue
            start, end = found, found + len(content)
        if truncated and i == last_assistant:
            found = text.rfind(content, start, end) if content else -1
            end = found + len(content) if found >= 0 else end
        spans.append((start, end))
        cursor = end
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int | None = None,
                          truncated: bool = False) -> TokenizedConversation:
    """Token ids of the chat-template rendering and the assistant loss mask (SPEC §5).

    The rendering is the target's own at inference: ``apply_chat_template(messages)``, so a template that
    injects a default system prompt (SmolLM2, Qwen) keeps it. Tokens are marked when their first character lies
    inside an assistant span (needs a fast tokenizer's offsets; slow tokenizers fall back to token prefixes).
    """
    text, spans = assistant_char_spans(tokenizer, messages, truncated=truncated)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(any(s <= begin < e for s, e in spans)) for begin, _ in enc["offset_mapping"]]
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        mask = [0] * len(ids)
        for s, e in spans:
            lo = len(tokenizer(text[:s], add_special_tokens=False)["input_ids"])
            hi = len(tokenizer(text[:e], add_special_tokens=False)["input_ids"])
            mask[lo:hi] = [1] * (hi - lo)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return TokenizedConversation(ids, mask)


def chat_template_hash(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return hashlib.sha256(str(template).encode()).hexdigest()[:16]


class ConversationFileError(ValueError):
    """A conversation file the cache cannot read (not UTF-8 text, damaged gzip data, a line that is not a record, a
    record without ``messages``, no records at all): the message names the file, the line and what is wrong."""


def read_jsonl(path: str | os.PathLike, complete_lines_only: bool = False) -> Iterator[dict]:
    """The records of a jsonl file (``.gz``: gzip-compressed), one JSON object a line.

    A line that is not valid JSON is skipped with a warning: an interrupted regeneration leaves one, and regenerates
    its conversation (``regenerate._done_ids``). Anything else wrong stops with a :class:`ConversationFileError`.
    ``complete_lines_only`` stops quietly at a last line without its newline: a regeneration beside the reader is
    still writing it.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if complete_lines_only and not line.endswith("\n"):
                    break
                line = line.strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    logger.warning("Skipping a damaged line %d in %s", line_no, path)
                    continue
                if not isinstance(record, dict):
                    raise ConversationFileError(f"{path}, line {line_no}: a JSON {type(record).__name__}, not a "
                                                "record (one JSON object a line).")
                yield record
    except UnicodeDecodeError:
        raise ConversationFileError(f"{path} is not UTF-8 text (a gzip-compressed file needs a name ending in "
                                    "'.gz').") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:  # a truncated or damaged download / copy
        raise ConversationFileError(f"{path}: damaged gzip data ({err}).") from None


def check_conversation(record: dict, path: str | os.PathLike, number: int) -> None:
    """Raise :class:`ConversationFileError` unless ``record`` (the ``number``-th of ``path``) holds a ``messages``
    list of ``{"role", "content"}`` turns."""
    messages = record.get("messages")
    if not (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)):
        raise ConversationFileError(
            f"{path}: record {number} (id {record.get('id')!r}) has no 'messages' list of {{'role', 'content'}} "
            f"turns (keys: {sorted(record)}). Training takes the target's answered conversations (the "
            "train.jsonl of hf-dspark regenerate), not prompt files.")


def read_conversations(path: str | os.PathLike) -> list[dict]:
    """The chat records ``{"id", "messages": [{"role", "content"}, ...]}`` of one file, checked before the target
    runs: a record without them (a prompt file passed as data) would otherwise fail after caching part of the
    file, and an empty file would leave a cache without conversations whose error comes only at training."""
    records = list(read_jsonl(path))
    for number, record in enumerate(records, 1):
        check_conversation(record, path, number)
    if not records:
        raise ConversationFileError(f"{path} holds no conversations: give the train.jsonl that hf-dspark regenerate "
                                    "wrote.")
    return records


# ---------------------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------------------
def load_manifest(cache_dir: str | os.PathLike) -> dict:
    path = Path(cache_dir) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"No target cache at {cache_dir}: {MANIFEST_NAME} is missing. Build one with "
                                "`hf-dspark cache` (or `hf-dspark train --data ...`).")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != CACHE_FORMAT or manifest.get("format_version", 0) > CACHE_FORMAT_VERSION:
        raise TargetCacheError(f"{path} is not a target cache this version can read (format "
                         f"{manifest.get('format')!r} v{manifest.get('format_version')}).")
    return manifest


def _write_manifest(cache_dir: Path, manifest: dict) -> None:
    tmp = cache_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, cache_dir / MANIFEST_NAME)


def _new_manifest(target, tokenizer, layer_ids: list[int], max_length: int, dtype: str,
                  min_loss_tokens: int, target_name: str | None) -> dict:
    tcfg = target.config.get_text_config()
    return {"format": CACHE_FORMAT, "format_version": CACHE_FORMAT_VERSION,
            "target_name_or_path": target_name or getattr(target, "name_or_path", None) or tcfg.name_or_path,
            "target_model_type": tcfg.model_type, "target_layer_ids": list(layer_ids),
            "hidden_size": tcfg.hidden_size, "num_target_layers": tcfg.num_hidden_layers,
            "vocab_size": target.get_input_embeddings().weight.shape[0],
            "embedding_signature": embedding_signature(target), "chat_template_sha256": chat_template_hash(tokenizer),
            "max_length": max_length, "min_loss_tokens": min_loss_tokens, "dtype": dtype,
            "num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0, "shards": []}


_RESUME_KEYS = ("target_model_type", "target_layer_ids", "hidden_size", "num_target_layers", "vocab_size",
                "chat_template_sha256", "max_length", "min_loss_tokens", "dtype")


def _raise_if_cannot_append(existing: dict, fresh: dict, cache_dir: Path) -> None:
    for key in _RESUME_KEYS:
        if existing.get(key) != fresh.get(key):
            raise TargetCacheError(f"The cache in {cache_dir} was built with {key}={existing.get(key)!r}, but this "
                                   f"run uses {key}={fresh.get(key)!r}. Use a new --out directory or the original "
                                   "settings.")
    if not _signatures_match(existing.get("embedding_signature"), fresh.get("embedding_signature")):
        raise TargetCacheError(f"The cache in {cache_dir} was built from a different target (embedding weights "
                               "differ). Use a new --out directory.")


def _raise_if_not_layers_of(layer_ids: list[int], num_layers: int) -> None:
    """Refuse layer ids the target does not have before anything is written (the tap raised a bare ValueError)."""
    beyond = [i for i in layer_ids if not 0 <= i < num_layers]
    if beyond:
        raise TargetCacheError(f"Cannot tap layer {beyond[0]}: the target has {num_layers} layers, 0 to "
                               f"{num_layers - 1}. Choose the layers to cache among them (--layers).")


def _signatures_match(a: list[float] | None, b: list[float] | None) -> bool:
    if not a or not b or len(a) != len(b):
        return True
    return all(abs(x - y) <= _SIGNATURE_RTOL * max(abs(y), 1e-3) for x, y in zip(a, b))


def _model_name(name_or_path: str) -> str:
    return Path(str(name_or_path).rstrip("/\\")).name.lower()


def validate_manifest(manifest: dict, drafter_config) -> None:
    """Refuse to train ``drafter_config`` on a cache built for another target or other tapped layers."""
    tcfg = drafter_config.target_config
    checks = [("target_layer_ids", manifest.get("target_layer_ids"), list(drafter_config.target_layer_ids),
               "build the drafter with the cache's layer ids (hf-dspark train reads them from the manifest)"),
              ("hidden_size", manifest.get("hidden_size"), tcfg.get("hidden_size"), "use the cache's target"),
              ("target_model_type", manifest.get("target_model_type"), tcfg.get("model_type"),
               "use the cache's target"),
              ("vocab_size", manifest.get("vocab_size"), tcfg.get("vocab_size"), "use the cache's target"),
              ("num_target_layers", manifest.get("num_target_layers"), drafter_config.num_target_layers,
               "use the cache's target")]
    name_cache, name_drafter = manifest.get("target_name_or_path"), drafter_config.target_name_or_path
    if name_cache and name_drafter and _model_name(name_cache) != _model_name(name_drafter):
        # compared by last path component: "org/Model" and "/local/copy/Model" are the same target
        checks.append(("target_name_or_path", name_cache, name_drafter, "rebuild the cache with this target"))
    for field_name, cached, wanted, fix in checks:
        if wanted is not None and cached != wanted:
            raise TargetCacheError(f"Target cache mismatch: the cache has {field_name}={cached!r} but the drafter "
                                   f"expects {field_name}={wanted!r}; {fix}.")
    if not _signatures_match(manifest.get("embedding_signature"), drafter_config.target_embedding_signature):
        raise TargetCacheError("Target cache mismatch: the cache was built from a target whose embedding weights "
                               "differ from the drafter's target (same shapes, different model); rebuild the cache.")


# ---------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------
def _cached_ids(cache_dir: Path, manifest: dict) -> set[str]:
    done: set[str] = set()
    for shard in manifest["shards"]:
        with safe_open(cache_dir / shard["file"], framework="pt") as f:
            done.update(json.loads(f.metadata()["ids"]))
    return done


@torch.inference_mode()
def run_target(target, tap: TargetFeatureTap, batch: list[TokenizedConversation],
               pad_token_id: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One padded target forward: per sample (tapped features [L, m·d], final post-norm hidden [L, d]).

    Only the base model runs (no LM head): the cache needs hidden states, never [L, V] logits.
    """
    device = next(target.parameters()).device
    longest = max(len(s.input_ids) for s in batch)
    ids = torch.full((len(batch), longest), pad_token_id, dtype=torch.long)
    attn = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, sample in enumerate(batch):  # right padding: causal attention keeps real positions exact
        ids[row, : len(sample.input_ids)] = torch.tensor(sample.input_ids)
        attn[row, : len(sample.input_ids)] = 1
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    out = decoder(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False)
    features, last = tap.features(), out.last_hidden_state
    return [(features[row, : len(s.input_ids)], last[row, : len(s.input_ids)]) for row, s in enumerate(batch)]


def _write_shard(cache_dir: Path, index: int, samples: list[tuple[str, TokenizedConversation, torch.Tensor,
                                                                   torch.Tensor]], dtype: torch.dtype) -> dict:
    lengths = [len(s.input_ids) for _, s, _, _ in samples]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    tensors = {
        "input_ids": torch.tensor([t for _, s, _, _ in samples for t in s.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([t for _, s, _, _ in samples for t in s.loss_mask], dtype=torch.uint8),
        "offsets": offsets.to(torch.int64),
        "target_hidden_states": torch.cat([f for _, _, f, _ in samples]).to(dtype).contiguous(),
        "target_last_hidden_states": torch.cat([h for _, _, _, h in samples]).to(dtype).contiguous(),
    }
    name = f"shard-{index:05d}.safetensors"
    tmp = cache_dir / (name + ".tmp")
    save_file(tensors, str(tmp), metadata={"ids": json.dumps([sid for sid, _, _, _ in samples])})
    os.replace(tmp, cache_dir / name)
    return {"file": name, "num_samples": len(samples), "num_tokens": int(offsets[-1]),
            "num_loss_tokens": int(tensors["loss_mask"].sum())}


def _tokenized_records(records: Iterable[dict], tokenizer, done: set[str], max_length: int,
                       min_loss_tokens: int, counts: dict) -> Iterator[tuple[str, TokenizedConversation]]:
    for record in records:
        sid = str(record.get("id") or hashlib.sha1(json.dumps(record["messages"]).encode()).hexdigest()[:16])
        if sid in done:
            counts["skipped_cached"] += 1
            continue
        done.add(sid)  # duplicates inside the input are cached once
        sample = tokenize_conversation(tokenizer, record["messages"], max_length,
                                       truncated=record.get("finish_reason") == "length")
        if sample.num_loss_tokens < min_loss_tokens:
            counts["dropped_short"] += 1
            continue
        yield sid, sample


def build_target_cache(target, tokenizer, records: Iterable[dict] | str | os.PathLike, out_dir: str | os.PathLike,
                       layer_ids: list[int] | None = None, max_length: int = 1024, batch_size: int = 8,
                       dtype: str = "bfloat16", min_loss_tokens: int = MIN_LOSS_TOKENS, shard_size_mb: int = 512,
                       target_name: str | None = None, progress: bool = True) -> dict:
    """Tokenise conversations, run the target once over each, and append them to the cache at ``out_dir``.

    ``records``: dicts with ``messages`` (and ``id``; a hash of the messages otherwise) or a jsonl path.
    Resumable: ids already cached are skipped. Returns the manifest.
    """
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(STORAGE_DTYPES)}.")
    cache_dir = Path(out_dir)
    tcfg = target.config.get_text_config()
    layer_ids = list(layer_ids) if layer_ids else default_target_layer_ids(tcfg.num_hidden_layers)
    _raise_if_not_layers_of(layer_ids, tcfg.num_hidden_layers)
    cache_dir.mkdir(parents=True, exist_ok=True)
    manifest = _new_manifest(target, tokenizer, layer_ids, max_length, dtype, min_loss_tokens, target_name)
    if (cache_dir / MANIFEST_NAME).is_file():
        existing = load_manifest(cache_dir)
        _raise_if_cannot_append(existing, manifest, cache_dir)
        manifest = existing
    done = _cached_ids(cache_dir, manifest)
    if isinstance(records, (str, os.PathLike)):
        records = read_conversations(records)
    counts = {"skipped_cached": 0, "dropped_short": 0}
    bytes_per_token = (len(layer_ids) + 1) * tcfg.hidden_size * STORAGE_DTYPES[dtype].itemsize + 5
    shard_tokens = max(1, shard_size_mb * 2**20 // bytes_per_token)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    bar = tqdm(desc="target cache", unit="sample", disable=not progress)
    pending: list[tuple[str, TokenizedConversation]] = []
    pending_tokens = 0
    with TargetFeatureTap(target, layer_ids) as tap:
        stream = _tokenized_records(records, tokenizer, done, max_length, min_loss_tokens, counts)
        for sid, sample in stream:
            pending.append((sid, sample))
            pending_tokens += len(sample.input_ids)
            if pending_tokens >= shard_tokens:
                _flush(target, tap, pending, cache_dir, manifest, batch_size, pad_id, dtype, bar)
                pending, pending_tokens = [], 0
        if pending:
            _flush(target, tap, pending, cache_dir, manifest, batch_size, pad_id, dtype, bar)
    bar.close()
    logger.info("Target cache %s: %d samples, %d tokens (%d skipped as cached, %d dropped with < %d loss tokens)",
                cache_dir, manifest["num_samples"], manifest["num_tokens"], counts["skipped_cached"],
                counts["dropped_short"], min_loss_tokens)
    _write_manifest(cache_dir, manifest)
    return manifest


def _flush(target, tap, pending, cache_dir: Path, manifest: dict, batch_size: int, pad_id: int, dtype: str,
           bar) -> None:
    """Run the target over ``pending`` (length-sorted batches: little padding), write one shard, update manifest."""
    order = sorted(range(len(pending)), key=lambda i: len(pending[i][1].input_ids))
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        outputs = run_target(target, tap, [pending[i][1] for i in rows], pad_id)
        for i, (features, last) in zip(rows, outputs):
            results[i] = (features.to("cpu", STORAGE_DTYPES[dtype]), last.to("cpu", STORAGE_DTYPES[dtype]))
        bar.update(len(rows))
    samples = [(sid, sample, *results[i]) for i, (sid, sample) in enumerate(pending)]
    shard = _write_shard(cache_dir, len(manifest["shards"]), samples, STORAGE_DTYPES[dtype])
    manifest["shards"].append(shard)
    for key in ("num_samples", "num_tokens", "num_loss_tokens"):
        manifest[key] += shard[key]
    _write_manifest(cache_dir, manifest)


# ---------------------------------------------------------------------------------------------------------
# Side-car: the target's log-normaliser per token (reduced-vocabulary training)
# ---------------------------------------------------------------------------------------------------------
LOGSUMEXP_SUFFIX = ".lse.safetensors"


def _logsumexp_file(cache_dir: Path, shard: dict) -> Path:
    return cache_dir / (shard["file"].removesuffix(".safetensors") + LOGSUMEXP_SUFFIX)


@torch.no_grad()
def write_target_logsumexp(cache_dir: str | os.PathLike, compute_logits, head_dtype: torch.dtype = torch.float32,
                           batch_tokens: int = 2048, progress: bool = True) -> int:
    """Store log Σ_v exp(target logit_v) for every cached token, once per shard (existing side-cars are kept).

    Why: a drafter with a reduced vocabulary needs the target's probabilities only on its own V' tokens,
    p_t(v) = exp(logit_v − lse). With lse on disk a training step multiplies by V' LM-head rows instead of all
    V (on SmolLM2 the full-vocabulary target softmax was ~40 % of a reduced-vocabulary step). ``compute_logits``
    maps post-norm hidden states to full-vocabulary logits (a drafter's ``compute_logits``, or
    :func:`target_logits_function`); ``head_dtype`` is the LM head's dtype, which the loss casts states to as
    well, so side-car and loss agree. Concurrent writers are safe (same content, atomic renames).
    Returns the number of shards written.
    """
    cache_dir = Path(cache_dir)
    manifest = load_manifest(cache_dir)
    todo = [s for s in manifest["shards"] if not _logsumexp_file(cache_dir, s).is_file()]
    bar = tqdm(total=sum(s["num_tokens"] for s in todo), desc="target logsumexp", unit="tok", disable=not progress)
    for shard in todo:
        with safe_open(cache_dir / shard["file"], framework="pt") as f:
            hidden = f.get_tensor("target_last_hidden_states")
        parts = []
        for start in range(0, hidden.shape[0], batch_tokens):
            logits = compute_logits(hidden[start:start + batch_tokens].to(head_dtype))
            parts.append(torch.logsumexp(logits.float(), dim=-1))
            bar.update(min(batch_tokens, hidden.shape[0] - start))
        out = _logsumexp_file(cache_dir, shard)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        save_file({"target_logsumexp": torch.cat(parts).contiguous()}, str(tmp))
        os.replace(tmp, out)
    bar.close()
    return len(todo)


def target_logits_function(target):
    """(post-norm hidden -> the target's logits, LM head dtype): what a drafter's ``compute_logits`` computes."""
    from ..modeling.families import get_target_family

    tcfg = target.config.get_text_config()
    head = target.get_output_embeddings()
    cap = get_target_family(tcfg.model_type).logit_softcap(tcfg)

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap_logits(torch.nn.functional.linear(hidden, head.weight.detach()), cap)

    return compute_logits, head.weight.dtype


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------
class TargetCacheDataset(Dataset):
    """Lazy reader of a target cache: item i -> dict of one sample's tensors (read from disk on access).

    File handles are opened per process on first use (and dropped when pickled), so DataLoader workers work.
    """

    def __init__(self, cache_dir: str | os.PathLike):
        self.cache_dir = Path(cache_dir)
        self.manifest = load_manifest(self.cache_dir)
        self._index: list[tuple[int, int, int]] = []  # (shard, start token, end token)
        self.ids: list[str] = []
        for shard_no, shard in enumerate(self.manifest["shards"]):
            with safe_open(self.cache_dir / shard["file"], framework="pt") as f:
                offsets = f.get_tensor("offsets").tolist()
                self.ids.extend(json.loads(f.metadata()["ids"]))
            self._index.extend((shard_no, a, b) for a, b in itertools.pairwise(offsets))
        self._handles: dict[int, object] = {}
        self._logsumexp: dict[int, torch.Tensor] | None = None
        if all(_logsumexp_file(self.cache_dir, s).is_file() for s in self.manifest["shards"]):
            self._logsumexp = {}
            for shard_no, shard in enumerate(self.manifest["shards"]):
                with safe_open(_logsumexp_file(self.cache_dir, shard), framework="pt") as f:
                    self._logsumexp[shard_no] = f.get_tensor("target_logsumexp")

    @property
    def has_logsumexp(self) -> bool:
        """Whether every shard has its :func:`write_target_logsumexp` side-car (items then carry it)."""
        return self._logsumexp is not None

    def __len__(self) -> int:
        return len(self._index)

    @property
    def lengths(self) -> list[int]:
        return [b - a for _, a, b in self._index]

    def _handle(self, shard_no: int):
        if shard_no not in self._handles:
            self._handles[shard_no] = safe_open(self.cache_dir / self.manifest["shards"][shard_no]["file"],
                                                framework="pt")
        return self._handles[shard_no]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard_no, a, b = self._index[i]
        f = self._handle(shard_no)
        item = {"input_ids": f.get_slice("input_ids")[a:b].long(),
                "loss_mask": f.get_slice("loss_mask")[a:b].long(),
                "target_hidden_states": f.get_slice("target_hidden_states")[a:b],
                "target_last_hidden_states": f.get_slice("target_last_hidden_states")[a:b]}
        if self._logsumexp is not None:
            item["target_logsumexp"] = self._logsumexp[shard_no][a:b]
        return item

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state


def collate_target_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad samples to the longest: input_ids/loss_mask [N, T] long, attention_mask [N, T] bool, states."""
    longest = max(s["input_ids"].shape[0] for s in samples)
    batch = {}
    keys = ["input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"]
    keys += ["target_logsumexp"] if "target_logsumexp" in samples[0] else []
    for key in keys:
        first = samples[0][key]
        out = first.new_zeros(len(samples), longest, *first.shape[1:])
        for row, s in enumerate(samples):
            out[row, : s[key].shape[0]] = s[key]
        batch[key] = out
    lengths = torch.tensor([s["input_ids"].shape[0] for s in samples])
    batch["attention_mask"] = torch.arange(longest)[None, :] < lengths[:, None]
    return batch
