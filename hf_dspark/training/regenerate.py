"""Regenerate answers with the target itself (the published recipe): the drafter learns the target's outputs.

Three back-ends:

* local — batched plain decoding (left padding, prompts sorted by length so a batch wastes little; an answer that
  ends leaves the batch, :mod:`~hf_dspark.training.shrinking_decode`);
* engine — our continuous-batching ``DSparkEngine`` (a finished answer leaves the batch at once and the next
  prompt takes its place, so no row idles until the longest answer of its batch ends; each prompt samples
  with its own seed, so its answer does not depend on which prompts shared its steps);
* ``endpoint`` — any OpenAI-compatible chat server (vLLM / SGLang) for scale.

Output is one jsonl record per prompt, ``{"id", "category", "messages": [user, assistant], "num_new_tokens",
"finish_reason"}``. Runs are resumable: records already in the output file are skipped, and every batch is
appended and flushed as soon as it finishes, so an interrupted run loses at most one batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessorList

from ..sampling import NucleusDraw
from .prompts import Prompt, dedupe, magpie_prefix
from .shrinking_decode import NextTokens, decode_shrinking, greedy_tokens, nucleus_sampler

logger = logging.getLogger(__name__)


@dataclass
class SamplingSettings:
    """The target's recommended sampling (SmolLM2's card: T=0.2, top-p 0.9). ``temperature=0`` means greedy."""

    temperature: float = 0.2
    top_p: float = 0.9
    top_k: int | None = None
    max_new_tokens: int = 384

    def generate_kwargs(self) -> dict:
        """``generate``'s arguments. Sampling draws inside a :class:`~hf_dspark.sampling.NucleusDraw` processor
        under greedy decoding: the same distribution as ``do_sample=True`` with these warpers, without sorting
        and drawing over the whole vocabulary for each of a batch's rows at every step."""
        if self.temperature <= 0:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens}
        draw = NucleusDraw(self.temperature, top_p=self.top_p, top_k=self.top_k)
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None,
                "logits_processor": LogitsProcessorList([draw]), "max_new_tokens": self.max_new_tokens}

    def next_tokens(self) -> NextTokens:
        """The same draw for :func:`~hf_dspark.training.shrinking_decode.decode_shrinking`."""
        if self.temperature <= 0:
            return greedy_tokens
        return nucleus_sampler(self.temperature, top_p=self.top_p, top_k=self.top_k)


def prompt_id(prompt: Prompt) -> str:
    return hashlib.sha1("\x1e".join(prompt.turns).encode()).hexdigest()[:16]


def _done_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    done = set()
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                done.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError):
                logger.warning("Skipping a damaged line in %s (an interrupted write); it will be regenerated", path)
    return done


def _record(prompt: Prompt, answer: str, num_new_tokens: int | None, finish_reason: str | None) -> dict:
    return {"id": prompt_id(prompt), "category": prompt.category,
            "messages": [{"role": "user", "content": prompt.first_turn}, {"role": "assistant", "content": answer}],
            "num_new_tokens": num_new_tokens, "finish_reason": finish_reason}


def _append_records(path: Path, records: Iterable[dict]) -> None:
    """Append JSON lines and close the file again. Why not one handle for the whole run: git (stash, checkout, pull)
    replaces a file it rewrites with a new one, and a run holding the old handle would go on writing every later
    answer into the unlinked file, where nothing reads it."""
    with path.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def _todo(prompts: Sequence[Prompt], out_path: Path) -> list[Prompt]:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = _done_ids(out_path)
    todo = [p for p in dedupe(prompts) if prompt_id(p) not in done]
    logger.info("%d prompts, %d already answered in %s", len(prompts), len(done), out_path)
    return todo


def _render(tokenizer, prompt: Prompt) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt.first_turn}], tokenize=False,
                                         add_generation_prompt=True)


def _generate_batch(model, tokenizer, texts: Sequence[str], settings: SamplingSettings, seed: int):
    tokenizer.padding_side = "left"
    enc = tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    eos_ids = model.generation_config.eos_token_id
    eos_ids = eos_ids if isinstance(eos_ids, list) else [eos_ids]
    rows = decode_shrinking(model, enc["input_ids"], enc["attention_mask"], settings.max_new_tokens,
                            next_tokens=settings.next_tokens(), eos_token_ids=eos_ids)
    return [(tokenizer.decode(row.tokens, skip_special_tokens=True), len(row.tokens) + int(row.finished),
             "stop" if row.finished else "length") for row in rows]


def regenerate_local(model, tokenizer, prompts: Sequence[Prompt], out_path: str | Path,
                     settings: SamplingSettings | None = None, batch_size: int = 16, seed: int = 0) -> int:
    """Answer every prompt not yet in ``out_path`` with the local target; returns the number of new records."""
    settings = settings or SamplingSettings()
    out_path = Path(out_path)
    todo = _todo(prompts, out_path)
    # Sort by length inside windows of 16 batches: little padding, yet an early stop still leaves the mix.
    window = batch_size * 16
    todo = [p for w in range(0, len(todo), window) for p in sorted(todo[w:w + window], key=lambda p: len(p.first_turn))]
    written = 0
    new_tokens = 0
    start = time.perf_counter()
    with tqdm(total=len(todo), desc="regenerate", unit="prompt") as bar:
        for b in range(0, len(todo), batch_size):
            batch = todo[b:b + batch_size]
            texts = [_render(tokenizer, p) for p in batch]
            results = _generate_batch(model, tokenizer, texts, settings, seed + b)
            _append_records(out_path, [_record(prompt, answer, n_tokens, reason)
                                       for prompt, (answer, n_tokens, reason) in zip(batch, results)])
            new_tokens += sum(n_tokens for _, n_tokens, _ in results)
            written += len(batch)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
    return written


def regenerate_endpoint(endpoint: str, model_name: str, prompts: Sequence[Prompt], out_path: str | Path,
                        settings: SamplingSettings | None = None, api_key: str = "EMPTY", timeout: float = 600) -> int:
    """Same as :func:`regenerate_local`, through an OpenAI-compatible ``/v1/chat/completions`` server."""
    import urllib.request

    settings = settings or SamplingSettings()
    out_path = Path(out_path)
    todo = _todo(prompts, out_path)
    url = endpoint.rstrip("/") + ("" if endpoint.rstrip("/").endswith("/chat/completions") else "/v1/chat/completions")
    written = 0
    for prompt in tqdm(todo, desc="regenerate", unit="prompt"):
        body = {"model": model_name, "messages": [{"role": "user", "content": prompt.first_turn}],
                "temperature": settings.temperature, "top_p": settings.top_p,
                "max_tokens": settings.max_new_tokens}
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            reply = json.loads(response.read())
        choice = reply["choices"][0]
        tokens = reply.get("usage", {}).get("completion_tokens")
        _append_records(out_path, [_record(prompt, choice["message"]["content"], tokens, choice.get("finish_reason"))])
        written += 1
    return written


def prompt_seed(prompt: Prompt, seed: int) -> int:
    """The sampling seed of one prompt: fixed by its text and the run's seed, not by its place in a batch."""
    return (seed * 1_000_003 + int(prompt_id(prompt), 16)) % (2**63 - 1)


def regenerate_with_engine(engine, tokenizer, prompts: Sequence[Prompt], out_path: str | Path,
                           settings: SamplingSettings | None = None, seed: int = 0, max_queued: int | None = None,
                           progress: bool = True) -> int:
    """Same as :func:`regenerate_local`, on a continuous-batching :class:`~hf_dspark.serving.DSparkEngine`.

    The engine is driven from this thread (do not ``start()`` it). At most ``max_queued`` prompts (default: the
    engine's ``max_running_requests`` plus as many waiting) are submitted ahead, and every answer is appended and
    flushed as it finishes, so an interrupted run loses only the answers in flight. Records are written in
    finishing order; a prompt's answer depends only on the prompt and ``seed``."""
    settings = settings or SamplingSettings()
    out_path = Path(out_path)
    todo = _todo(prompts, out_path)
    max_queued = max_queued or 2 * engine.max_running_requests
    sampling = ({"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p,
                 "top_k": settings.top_k} if settings.temperature > 0 else {"do_sample": False})
    pending = deque(todo)
    in_flight: list[tuple[Prompt, object]] = []
    written = new_tokens = 0
    start = time.perf_counter()
    with tqdm(total=len(todo), desc="regenerate", unit="prompt", disable=not progress) as bar:
        while pending or in_flight:
            while pending and len(in_flight) < max_queued:
                prompt = pending.popleft()
                ids = tokenizer(_render(tokenizer, prompt), add_special_tokens=False)["input_ids"]
                handle = engine.submit(ids, settings.max_new_tokens, seed=prompt_seed(prompt, seed), **sampling)
                in_flight.append((prompt, handle))
            engine.step()
            still = []
            for prompt, handle in in_flight:
                if not handle.done():
                    still.append((prompt, handle))
                    continue
                output = handle.result()
                finished = output.finish_reason == "stop"  # FinishReason is a str enum: its value
                tokens = output.token_ids[:-1] if finished else output.token_ids
                answer = tokenizer.decode(tokens, skip_special_tokens=True)
                _append_records(out_path, [_record(prompt, answer, len(output.token_ids),
                                                   "stop" if finished else "length")])
                new_tokens += len(output.token_ids)
                written += 1
                bar.update(1)
            in_flight = still
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}", refresh=False)
    return written


@torch.inference_mode()
def synthesise_magpie_prompts(model, tokenizer, num: int, batch_size: int = 32, max_new_tokens: int = 96,
                              temperature: float = 1.0, top_p: float = 0.95, seed: int = 0,
                              system_prompts: Sequence[str | None] = (None,), guard=None,
                              out_path: str | Path | None = None, progress: bool = True) -> list[Prompt]:
    """Let the instruct target write user requests itself (Magpie), de-duplicated and overlap-checked.

    With ``out_path`` every batch's new prompts are appended to that jsonl as they come (with the batch index),
    and a rerun continues after the last batch written: on a CPU this takes tens of minutes, and a stopped run
    must not lose them. Batch k always uses seed + k and system prompt k mod len, so a resumed run produces
    what an uninterrupted one would."""
    prompts: list[Prompt] = []
    first_attempt = 0
    path = Path(out_path) if out_path is not None else None
    if path is not None and path.exists():
        text = path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):  # a write cut short: drop the partial line before appending
            logger.warning("magpie: dropping a partial last line of %s (an interrupted write)", path)
            text = text[: text.rfind("\n") + 1]
            path.write_text(text, encoding="utf-8")
        for line in text.splitlines():
            if line.strip():
                record = json.loads(line)
                prompts.append(Prompt(tuple(record["turns"]), record.get("category", "magpie")))
                first_attempt = max(first_attempt, int(record.get("attempt", -1)) + 1)
        if len(prompts) >= num:
            return prompts[:num]
    eos = tokenizer.eos_token_id  # the end of the user's turn
    stop_ids = model.generation_config.eos_token_id  # where generate would stop too
    stop_ids = [] if stop_ids is None else stop_ids if isinstance(stop_ids, list) else [stop_ids]
    max_attempts = max(4, 4 * num // batch_size)
    bar = tqdm(total=num, initial=len(prompts), desc="magpie prompts", disable=not progress)
    attempts = first_attempt
    while len(prompts) < num and attempts < max_attempts:
        system = system_prompts[attempts % len(system_prompts)]
        prefix = magpie_prefix(tokenizer, system)
        enc = tokenizer([prefix] * batch_size, return_tensors="pt", add_special_tokens=False)
        torch.manual_seed(seed + attempts)
        sampling = SamplingSettings(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        rows = decode_shrinking(model, enc["input_ids"], enc["attention_mask"], max_new_tokens,
                                next_tokens=sampling.next_tokens(), eos_token_ids={eos, *stop_ids})
        known = len(prompts)
        for row in rows:
            if row.stop_token != eos:  # the request never ended (or ended the text, not the turn): drop it
                continue
            text = tokenizer.decode(row.tokens, skip_special_tokens=True).strip()
            if 12 <= len(text) and (guard is None or not guard.overlaps(text)):
                prompts.append(Prompt((text,), "magpie"))
        prompts = dedupe(prompts)
        if path is not None:
            _append_records(path, [{"turns": list(prompt.turns), "category": prompt.category, "attempt": attempts}
                                   for prompt in prompts[known:]])
        bar.update(len(prompts) - known)
        attempts += 1
    bar.close()
    if len(prompts) < num:
        logger.warning("magpie: only %d distinct prompts after %d batches (asked for %d)", len(prompts), attempts, num)
    return prompts[:num]
