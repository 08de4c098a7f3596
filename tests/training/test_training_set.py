"""training.training_set (``hf-dspark regenerate``): which prompts, in which order, refused when they overlap the
evaluation sets, answered by the target into train.jsonl (resumable)."""

from __future__ import annotations

import json

import pytest
from chat_data import make_chat_tokenizer, single_thread  # noqa: F401
from conftest import make_tiny_llama

from hf_dspark.training.prompts import EvalOverlapGuard, Prompt
from hf_dspark.training.regenerate import SamplingSettings
from hf_dspark.training.training_set import TrainingSetRecipe, gather_prompts, interleave, regenerate_training_set

pytestmark = pytest.mark.usefixtures("single_thread")


def test_interleave_round_robin():
    a, b = [Prompt(("a1",)), Prompt(("a2",)), Prompt(("a3",))], [Prompt(("b1",))]
    assert [p.turns[0] for p in interleave(a, b, [])] == ["a1", "b1", "a2", "a3"]


def test_unknown_source_is_refused():
    with pytest.raises(ValueError, match="unknown prompt sources"):
        TrainingSetRecipe(sources=["wiki"])


def test_composed_chat_requests_join_the_mix(tmp_path):
    recipe = TrainingSetRecipe(num_template=2, num_magpie=0, sources=["requests"], num_requests=5)
    prompts = gather_prompts(None, None, tmp_path / "out", recipe, EvalOverlapGuard([]))
    assert [p.category.startswith("request-") for p in prompts] == [False, True, False, True, True, True, True]


def own_prompts(tmp_path, texts):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))
    return path


def test_prompts_yours_first_then_templated_and_written_once(tmp_path):
    recipe = TrainingSetRecipe(prompt_files=[own_prompts(tmp_path, ["count one two", "count one two", "red cat"])],
                               num_template=3, num_magpie=0)
    prompts = gather_prompts(None, None, tmp_path / "out", recipe, EvalOverlapGuard([]))
    assert [p.turns[0] for p in prompts[:1]] == ["count one two"] and len(prompts) == 5  # de-duplicated, mixed
    written = (tmp_path / "out" / "prompts_template.jsonl").read_text()
    assert prompts == gather_prompts(None, None, tmp_path / "out", recipe, EvalOverlapGuard([]))  # rerun: same
    assert (tmp_path / "out" / "prompts_template.jsonl").read_text() == written


def test_prompts_overlapping_the_evaluation_sets_are_refused(tmp_path):
    benchmark = "natalia sold clips to forty eight of her friends in april and then she sold half as many in may"
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "gsm8k.jsonl").write_text(json.dumps({"turns": [benchmark]}) + "\n")
    recipe = TrainingSetRecipe(prompt_files=[own_prompts(tmp_path, [benchmark])], num_template=0, num_magpie=0)
    with pytest.raises(ValueError, match="overlap"):
        regenerate_training_set(None, None, tmp_path / "out", recipe, tmp_path / "eval")


def test_answers_from_the_target_into_train_jsonl(tmp_path):
    target, tokenizer = make_tiny_llama(), make_chat_tokenizer()
    recipe = TrainingSetRecipe(prompt_files=[own_prompts(tmp_path, ["count one two", "red cat", "blue sky ?"])],
                               num_template=0, num_magpie=0, sampling=SamplingSettings(max_new_tokens=4))
    (tmp_path / "eval").mkdir()
    train = regenerate_training_set(target, tokenizer, tmp_path / "out", recipe, tmp_path / "eval", batch_size=2)
    records = [json.loads(line) for line in train.read_text().splitlines()]
    assert sorted(r["messages"][0]["content"] for r in records) == ["blue sky ?", "count one two", "red cat"]
    assert all(r["messages"][1]["role"] == "assistant" for r in records)
    regenerate_training_set(target, tokenizer, tmp_path / "out", recipe, tmp_path / "eval", batch_size=2)
    assert len(train.read_text().splitlines()) == 3  # resumable: nothing answered twice


def test_a_rerun_asking_for_more_templated_prompts_gets_them(tmp_path):
    """The templated prompts are written once for reruns; a rerun with a larger --num-template read the smaller
    file back and silently answered only the prompts of the first run (0 after a first run with 0)."""
    guard = EvalOverlapGuard([])
    assert gather_prompts(None, None, tmp_path, TrainingSetRecipe(num_template=0, num_magpie=0), guard) == []
    first = gather_prompts(None, None, tmp_path, TrainingSetRecipe(num_template=3, num_magpie=0), guard)
    more = gather_prompts(None, None, tmp_path, TrainingSetRecipe(num_template=5, num_magpie=0), guard)
    assert len(first) == 3 and len(more) == 5 and more[:3] == first  # the same seed: the first run's come first
    assert gather_prompts(None, None, tmp_path, TrainingSetRecipe(num_template=2, num_magpie=0), guard) == first[:2]
