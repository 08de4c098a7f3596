"""The feature memo hands back exactly what a prefill computes, never another target's, and survives bad files."""

from __future__ import annotations

import json

import pytest
import torch
from chat_data import make_chat_records, make_chat_tokenizer, single_thread  # noqa: F401
from conftest import make_tiny_llama

from hf_dspark.training import prefill_features
from hf_dspark.training.prefill_features import TargetPrefillDataset

LAYERS = [0, 2]


@pytest.fixture(scope="module")
def tokenizer():
    return make_chat_tokenizer()


def _dataset(target, tokenizer, memo, records=None, layers=LAYERS, **kwargs):
    return TargetPrefillDataset(target, tokenizer, records or make_chat_records(5), layers, logsumexp=True,
                                progress=False, memo_dir=memo, **kwargs)


def _no_prefill(*args, **kwargs):
    raise AssertionError("prefilled although the memo holds these features")


def test_a_second_read_comes_from_the_memo_and_equals_the_prefill(tmp_path, tokenizer, single_thread, monkeypatch):
    target = make_tiny_llama(num_layers=4).eval()
    first = _dataset(target, tokenizer, tmp_path / "memo")
    prefilled = [first[i] for i in range(len(first))]
    assert first.memo.misses == len(first) and first.memo.hits == 0 and first.memo.used_bytes > 0
    monkeypatch.setattr(prefill_features, "run_target", _no_prefill)
    again = _dataset(target, tokenizer, tmp_path / "memo")  # a new process / epoch: same folder, nothing prefilled
    for i in range(len(again)):
        a, b = prefilled[i], again[i]
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]) and a[key].dtype == b[key].dtype, key
    assert again.memo.hits == len(again) and again.memo.misses == 0


def test_features_of_another_target_or_other_layers_are_never_shared(tmp_path, tokenizer, single_thread):
    target = make_tiny_llama(num_layers=4).eval()
    torch.manual_seed(123)
    other = make_tiny_llama(num_layers=4).eval()
    with torch.no_grad():
        other.model.layers[3].mlp.down_proj.weight.mul_(1.5)  # same embeddings, different weights (a fine-tune)
    records = make_chat_records(3)
    memo = tmp_path / "memo"
    base = _dataset(target, tokenizer, memo, records)
    [base[i] for i in range(len(base))]
    for model, layers in ((other, LAYERS), (target, [1, 3])):
        data = _dataset(model, tokenizer, memo, records, layers=layers)
        assert data.memo.dir != base.memo.dir
        fresh = TargetPrefillDataset(model, tokenizer, records, layers, logsumexp=True, progress=False)
        for i in range(len(data)):
            torch.testing.assert_close(data[i]["target_hidden_states"], fresh[i]["target_hidden_states"])
        assert data.memo.hits == 0
    assert json.loads((base.memo.dir / "signature.json").read_text())["layer_ids"] == LAYERS


def test_an_unreadable_entry_is_prefilled_again_and_replaced(tmp_path, tokenizer, single_thread, caplog):
    target = make_tiny_llama(num_layers=4).eval()
    data = _dataset(target, tokenizer, tmp_path / "memo")
    expected = data[0]
    files = sorted(data.memo.dir.glob("*/*.safetensors"))
    assert len(files) == 1
    files[0].write_bytes(files[0].read_bytes()[:100])  # a truncated file (a disk filled up mid-copy)
    again = _dataset(target, tokenizer, tmp_path / "memo")
    with caplog.at_level("WARNING"):
        item = again[0]
    assert "unreadable" in caplog.text
    for key in expected:
        assert torch.equal(item[key], expected[key]), key
    third = _dataset(target, tokenizer, tmp_path / "memo")
    third[0]
    assert third.memo.hits == 1  # the entry was rewritten whole


def test_past_its_cap_the_memo_stores_nothing_more_and_items_stay_exact(tmp_path, tokenizer, single_thread):
    target = make_tiny_llama(num_layers=4).eval()
    plain = TargetPrefillDataset(target, tokenizer, make_chat_records(5), LAYERS, logsumexp=True, progress=False)
    one = plain[0]
    size = sum(one[k].numel() * one[k].element_size() for k in one if k.startswith("target_"))
    capped = _dataset(target, tokenizer, tmp_path / "memo", memo_max_bytes=int(size * 1.5))
    for i in range(len(capped)):
        for key, value in plain[i].items():
            assert torch.equal(capped[i][key], value), key
    assert len(list(capped.memo.dir.glob("*/*.safetensors"))) == 1
    assert capped.memo.used_bytes <= size * 1.5


def test_fill_feature_memo_prefills_what_the_run_will_read(tmp_path, tokenizer, single_thread, monkeypatch):
    from hf_dspark import DSparkDraftModel
    from hf_dspark.training import continuous

    target = make_tiny_llama(num_layers=4).eval()
    torch.manual_seed(0)
    DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8,
                                 target_layer_ids=LAYERS).save_pretrained(tmp_path / "best")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_chat_records(6)))
    recipe = continuous.ContinuousRecipe(data=[str(data)], heldout_cache="unused", run_dir=str(tmp_path / "run"),
                                         best_dir=str(tmp_path / "best"), curve_file=str(tmp_path / "curve.jsonl"),
                                         bf16_features=False, feature_memo=str(tmp_path / "memo"))
    assert continuous.fill_feature_memo(target, tokenizer, recipe) == 6
    assert continuous.fill_feature_memo(target, tokenizer, recipe) == 0  # a second fill finds everything stored
    monkeypatch.setattr(prefill_features, "run_target", _no_prefill)
    drafter = continuous.start_drafter(target, recipe)
    records = continuous._DataFiles(recipe.data).records()
    run_data = continuous.prefill_dataset(target, tokenizer, recipe, drafter, records,
                                          continuous.feature_target_for(target, recipe))
    assert all(run_data[i]["target_hidden_states"].shape[1] == 2 * target.config.hidden_size
               for i in range(len(run_data)))


def test_repeated_ngrams_are_the_completions_of_earlier_ngrams():
    from hf_dspark.training.repetition import mask_repeats, repeated_ngram_mask

    ids = torch.tensor([5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8])
    assert repeated_ngram_mask(ids, 3).tolist() == [False] * 6 + [True, False, False, False, True, True]
    assert not repeated_ngram_mask(ids, 5).any()
    run = torch.tensor([4, 4, 4, 4, 4])
    assert repeated_ngram_mask(run, 2).tolist() == [False, False, True, True, True]
    mask = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1])
    assert mask_repeats(mask, ids, 3).tolist() == [0, 0, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0]
    with pytest.raises(ValueError):
        repeated_ngram_mask(ids, 0)


def test_skip_repeats_masks_loops_after_the_memo_which_keeps_whole_answers(tmp_path, tokenizer, single_thread):
    from hf_dspark.training.repetition import repeated_ngram_mask

    target = make_tiny_llama(num_layers=4).eval()
    loop = "the cat sat on the mat. " * 6
    records = [{"id": "loop", "messages": [{"role": "user", "content": "Say it again and again."},
                                           {"role": "assistant", "content": loop}]}]
    full = _dataset(target, tokenizer, tmp_path / "memo", records)
    skipping = _dataset(target, tokenizer, tmp_path / "memo", records, skip_repeats=4)
    a, b = full[0], skipping[0]
    assert skipping.memo.hits == 1  # the same memo entry serves both
    repeats = repeated_ngram_mask(a["input_ids"], 4)
    assert (a["loss_mask"].bool() & repeats).sum() > a["loss_mask"].sum() // 2  # most of the loop is masked
    assert torch.equal(b["loss_mask"], a["loss_mask"].masked_fill(repeats, 0))
    for key in ("input_ids", "target_hidden_states", "target_logsumexp"):
        assert torch.equal(a[key], b[key]), key
