"""Target features computed while training: the target prefills a conversation when the trainer reads it.

Why next to the on-disk cache (:mod:`.target_cache`): the cache costs about 7 KB a token (five tapped layers and the
final state of a 576-wide target, bf16), so ten million tokens of human-written text would take 70 GB, while one
prefill of a 135M target in bf16 costs about as much as the drafter's training step on the same sequence. Computing
features on demand makes the training signal as large as the text the machine has; ``memo_dir`` keeps what was
prefilled (:mod:`.feature_memo`, capped) so that a run reading the same conversations epoch after epoch prefills
each once.

Items are exactly what :class:`~.target_cache.TargetCacheDataset` returns (the trainer, the validation helpers and
the collate function take either): ``input_ids``, ``loss_mask``, ``target_hidden_states`` [T, m·d],
``target_last_hidden_states`` [T, d] in ``feature_dtype``, and with ``logsumexp`` the target's log-normaliser
[T] at the answer positions (0 elsewhere: the loss reads it only where a block is supervised, which is always an
answer position), computed with the target's own LM head in its own dtype as the cache's side-car is.

``feature_target`` may be a lower-precision copy of the target (bf16 prefill is twice as fast on CPUs with bf16
matmuls); the drafter is then trained on bf16 features and served on the target's own, as GPU recipes do.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ..modeling.configuration import default_target_layer_ids
from ..modeling.target_taps import TargetFeatureTap
from .feature_memo import FeatureMemo, memo_signature
from .repetition import mask_repeats
from .target_cache import MIN_LOSS_TOKENS, TokenizedConversation, check_conversation, read_jsonl, run_target, \
    target_logits_function, tokenize_conversation

logger = logging.getLogger(__name__)


def read_chat_records(paths: Sequence[str | os.PathLike]) -> list[dict]:
    """Chat records ``{"id", "messages", ...}`` from jsonl or jsonl.gz files, in order (duplicate ids kept once).

    Read as the target cache reads them (:func:`~.target_cache.read_jsonl`: a damaged line skipped with a warning, a
    record without ``messages`` a :class:`~.target_cache.ConversationFileError` naming the file), except that a last
    line still being written by a regeneration beside the run is left for the next read."""
    records, seen = [], set()
    for path in paths:
        for number, record in enumerate(read_jsonl(path, complete_lines_only=True), 1):
            check_conversation(record, path, number)
            sid = str(record.get("id") or hashlib.sha1(json.dumps(record["messages"]).encode()).hexdigest()[:16])
            if sid not in seen:
                seen.add(sid)
                records.append({**record, "id": sid})
    return records


class TargetPrefillDataset(Dataset):
    """Chat records whose target features are computed on access (see the module docstring).

    ``target``: the target the drafter is trained for (its LM head gives the log-normaliser);
    ``feature_target``: the model that prefills (default ``target``; a bf16 copy is the fast choice on CPU).
    Records with fewer than ``min_loss_tokens`` answer tokens are dropped, as the cache drops them.
    """

    def __init__(self, target, tokenizer, records: Iterable[dict], layer_ids: Sequence[int] | None = None,
                 max_length: int = 1024, min_loss_tokens: int = MIN_LOSS_TOKENS, feature_target=None,
                 feature_dtype: torch.dtype = torch.bfloat16, logsumexp: bool = False, progress: bool = True,
                 memo_dir: str | os.PathLike | None = None, memo_max_bytes: int | None = None,
                 skip_repeats: int | None = None):
        tcfg = target.config.get_text_config()
        self.layer_ids = list(layer_ids) if layer_ids else default_target_layer_ids(tcfg.num_hidden_layers)
        self.target, self.feature_target = target, feature_target if feature_target is not None else target
        self.feature_dtype, self.logsumexp = feature_dtype, logsumexp
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.ids: list[str] = []
        self.samples: list[TokenizedConversation] = []
        dropped = 0
        for record in tqdm(list(records), desc="tokenize", unit="record", disable=not progress):
            sample = tokenize_conversation(tokenizer, record["messages"], max_length,
                                           truncated=record.get("finish_reason") == "length")
            if sample.num_loss_tokens < min_loss_tokens:
                dropped += 1
                continue
            self.ids.append(str(record["id"]))
            self.samples.append(sample)
        logger.info("%d conversations (%d tokens, %d answer tokens); %d dropped with < %d answer tokens",
                    len(self.samples), sum(self.lengths), self.num_loss_tokens, dropped, min_loss_tokens)
        self._tap: TargetFeatureTap | None = None
        self._logits = target_logits_function(target) if logsumexp else None
        # n: answer tokens completing an n-gram seen earlier get no loss (repetition.py)
        self.skip_repeats = skip_repeats
        self.memo = None
        if memo_dir is not None:
            signature = memo_signature(target, self.feature_target, self.layer_ids, feature_dtype, logsumexp)
            self.memo = FeatureMemo(memo_dir, signature, memo_max_bytes)

    @property
    def has_logsumexp(self) -> bool:
        return self.logsumexp

    @property
    def lengths(self) -> list[int]:
        return [len(s.input_ids) for s in self.samples]

    @property
    def num_loss_tokens(self) -> int:
        return sum(s.num_loss_tokens for s in self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = self.samples[i]
        loss_mask = torch.tensor(sample.loss_mask, dtype=torch.long)
        item = {"input_ids": torch.tensor(sample.input_ids, dtype=torch.long), "loss_mask": loss_mask}
        stored = self.memo.load(sample.input_ids, sample.loss_mask) if self.memo is not None else None
        if stored is not None:
            item.update(stored)
        else:
            item.update(self._prefill(sample, loss_mask))
            if self.memo is not None:
                self.memo.store(sample.input_ids, sample.loss_mask, item)
        if self.skip_repeats:  # after the memo: its entries (and the log-normaliser rows) stay the full answer's
            item["loss_mask"] = mask_repeats(loss_mask, item["input_ids"], self.skip_repeats)
        return item

    def _prefill(self, sample: TokenizedConversation, loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        if self._tap is None:  # attached on first use, so a dataset that is never read leaves no hooks behind
            self._tap = TargetFeatureTap(self.feature_target, self.layer_ids).attach()
        (features, last), = run_target(self.feature_target, self._tap, [sample], self.pad_id)
        # clone: run_target's outputs are inference tensors, which autograd refuses to save for the drafter's backward
        features, last = features.to("cpu", self.feature_dtype).clone(), last.to("cpu", self.feature_dtype).clone()
        item = {"target_hidden_states": features, "target_last_hidden_states": last}
        if self.logsumexp:
            item["target_logsumexp"] = self._answer_logsumexp(last, loss_mask)
        return item

    @torch.no_grad()
    def _answer_logsumexp(self, last: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        compute_logits, head_dtype = self._logits
        out = torch.zeros(last.shape[0], dtype=torch.float32)
        rows = loss_mask.bool()
        if rows.any():
            device = next(self.target.parameters()).device
            logits = compute_logits(last[rows].to(device, head_dtype))
            out[rows] = torch.logsumexp(logits.float(), dim=-1).cpu()
        return out

    def close(self) -> None:
        """Remove the feature tap's hooks from the target."""
        if self._tap is not None:
            self._tap.detach()
            self._tap = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_tap"] = None
        return state


def chat_record_files(patterns: Sequence[str | os.PathLike]) -> list[Path]:
    """Files named by paths or glob patterns, sorted within each pattern (missing plain paths raise)."""
    files: list[Path] = []
    for pattern in map(str, patterns):
        if any(ch in pattern for ch in "*?["):
            files.extend(sorted(Path(p) for p in glob.glob(pattern)))
        elif Path(pattern).is_file():
            files.append(Path(pattern))
        else:
            raise FileNotFoundError(f"No chat-record file {pattern}.")
    return files


__all__ = ["TargetPrefillDataset", "chat_record_files", "read_chat_records"]
