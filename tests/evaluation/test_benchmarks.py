"""Benchmark selection follows DeepSpec: caps, seeded shuffle only above the cap, first turn, chat template."""

from __future__ import annotations

import random

import pytest
from eval_fixtures import CHAT, MATH, make_chat_tokenizer, write_eval_dir

from hf_dspark.evaluation.benchmarks import (
    DEEPSPEC_SAMPLE_CAPS,
    DEEPSPEC_SEED,
    default_eval_dir,
    encode_chat_prompt,
    left_pad,
    load_benchmark,
    select_samples,
)


def test_select_samples_shuffles_with_the_seed_only_above_the_cap():
    items = list(range(10))
    expected = list(range(10))
    random.Random(DEEPSPEC_SEED).shuffle(expected)
    assert select_samples(items, 4) == expected[:4]
    assert select_samples(items, 10) == items and select_samples(items, None) == items
    assert select_samples(items, 4, seed=1) != select_samples(items, 4)


def test_load_benchmark_first_turns_and_caps(tmp_path):
    eval_dir = write_eval_dir(tmp_path)
    chat = load_benchmark("mt-bench", eval_dir)
    assert chat.prompts == tuple(t[0] for t in CHAT) and chat.category == "chat"  # cap 80 > 3: file order
    capped = load_benchmark("gsm8k", eval_dir, cap=2)
    shuffled = list(MATH)
    random.Random(DEEPSPEC_SEED).shuffle(shuffled)
    assert capped.prompts == tuple(shuffled[:2])
    with pytest.raises(FileNotFoundError, match="--eval-dir"):
        load_benchmark("humaneval", eval_dir)


def test_shared_eval_files_and_deepspec_caps():
    directory = default_eval_dir()
    if not (directory / "gsm8k.jsonl").is_file():
        pytest.skip(f"no shared evaluation files at {directory}")
    assert len(load_benchmark("gsm8k").prompts) == DEEPSPEC_SAMPLE_CAPS["gsm8k"] == 500
    assert len(load_benchmark("mbpp").prompts) == 256  # 257 lines, capped as DeepSpec does
    mt = load_benchmark("mt-bench")
    assert len(mt.prompts) == 80 and not mt.prompts[0].startswith("[")


def test_encode_chat_prompt_has_the_generation_prompt_and_no_extra_specials():
    tok = make_chat_tokenizer()
    ids = encode_chat_prompt(tok, "what red tree ?")
    start, user, assistant = tok.convert_tokens_to_ids(["<|im_start|>", "user", "assistant"])
    assert ids[-3:] == tok.convert_tokens_to_ids(["<|im_start|>", "assistant", "\n"])  # generation prompt
    # the template's own system turn, one user turn, the generation prompt: nothing added twice
    assert ids.count(start) == 3 and ids.count(user) == 1 and ids[0] == start
    assert tok.convert_tokens_to_ids(["what", " ", "red"]) == ids[ids.index(user) + 2:ids.index(user) + 5]
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat_prompt(tok, "x")


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_eval_dir_resolution_env_first_then_checkout_then_working_directory(tmp_path, monkeypatch):
    from hf_dspark.evaluation.benchmarks import EVAL_DIR_ENV, benchmark_path, eval_dir_candidates

    monkeypatch.delenv(EVAL_DIR_ENV, raising=False)
    work = tmp_path / "repo"
    (tmp_path / "shared" / "eval_datasets").mkdir(parents=True)
    work.mkdir()
    monkeypatch.chdir(work)
    candidates = eval_dir_candidates()
    assert candidates[-1] == tmp_path / "shared" / "eval_datasets"  # a wheel run from inside a checkout finds it
    if not any(c.is_dir() for c in candidates[:-1]):
        assert default_eval_dir() == candidates[-1]
    monkeypatch.setenv(EVAL_DIR_ENV, str(tmp_path / "mine"))  # set: used, even when missing (reported, not replaced)
    assert default_eval_dir() == tmp_path / "mine" and eval_dir_candidates()[0] == tmp_path / "mine"
    with pytest.raises(FileNotFoundError, match=rf"gsm8k.jsonl not found \(looked in {tmp_path / 'mine'}.*"
                                                rf"\${EVAL_DIR_ENV}"):
        benchmark_path("gsm8k")
    with pytest.raises(FileNotFoundError, match="looked in /nowhere\\)"):
        load_benchmark("gsm8k", eval_dir="/nowhere")
