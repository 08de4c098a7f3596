import gzip
import json
import pickle
import re

import pytest
import torch
from chat_data import make_chat_records, make_chat_tokenizer, single_thread  # noqa: F401
from conftest import make_tiny_llama, make_tiny_qwen3

from hf_dspark import DSparkDraftModel
from hf_dspark.training.target_cache import (
    MANIFEST_NAME,
    ConversationFileError,
    TargetCacheDataset,
    build_target_cache,
    collate_target_batch,
    load_manifest,
    read_conversations,
    tokenize_conversation,
    validate_manifest,
)

LAYERS = [1, 2]
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def chat_tokenizer():
    return make_chat_tokenizer()


def _masked_text(tokenizer, sample) -> str:
    return "".join(tokenizer.convert_ids_to_tokens([t for t, m in zip(sample.input_ids, sample.loss_mask) if m]))


def test_loss_mask_covers_assistant_content_through_end_of_turn(chat_tokenizer):
    record = make_chat_records(10)[9]  # two exchanges
    sample = tokenize_conversation(chat_tokenizer, record["messages"])
    tokens = chat_tokenizer.convert_ids_to_tokens(sample.input_ids)
    # the template's default system prompt is kept, and never trained on
    assert "".join(tokens[:2]) == "<|im_start|>system" and sample.loss_mask[:14] == [0] * 14
    expected = "".join(m["content"] + "<|im_end|>\n" for m in record["messages"] if m["role"] == "assistant")
    assert _masked_text(chat_tokenizer, sample) == expected
    # assistant headers and user turns are outside the mask: every masked run starts right after "assistant\n"
    starts = [i for i in range(1, len(tokens)) if sample.loss_mask[i] and not sample.loss_mask[i - 1]]
    assert len(starts) == 2
    assert all(tokens[i - 3:i] == ["<|im_start|>", "assistant", "\n"] for i in starts)


def test_truncated_answer_is_not_taught_an_end_of_turn(chat_tokenizer):
    record = make_chat_records(1)[0]
    sample = tokenize_conversation(chat_tokenizer, record["messages"], truncated=True)
    assert _masked_text(chat_tokenizer, sample) == record["messages"][1]["content"]


def test_max_length_truncates_ids_and_mask(chat_tokenizer):
    record = make_chat_records(1)[0]
    full = tokenize_conversation(chat_tokenizer, record["messages"])
    cut = tokenize_conversation(chat_tokenizer, record["messages"], max_length=30)
    assert cut.input_ids == full.input_ids[:30] and cut.loss_mask == full.loss_mask[:30]


@pytest.mark.slow
def test_smollm2_template_mask():
    from transformers import AutoTokenizer

    from hf_dspark.embedded import converted_target_dir

    path = converted_target_dir()
    if not (path / "tokenizer.json").is_file():
        pytest.skip("embedded SmolLM2 not converted yet")
    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 = 4."}]
    sample = tokenize_conversation(tok, messages)
    assert tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m]) == "2+2 = 4.<|im_end|>\n"
    assert "SmolLM" in tok.decode(sample.input_ids)  # the default system prompt is kept


@pytest.fixture
def built_cache(tmp_path, chat_tokenizer):
    target = make_tiny_llama(num_layers=4)
    records = make_chat_records(12)
    records[3]["messages"][1]["content"] = "one two"  # < 14 loss tokens: dropped
    manifest = build_target_cache(target, chat_tokenizer, records, tmp_path / "cache", layer_ids=LAYERS,
                                  max_length=64, batch_size=4, dtype="float32", progress=False)
    return target, records, manifest, tmp_path / "cache"


def test_cache_round_trip_matches_the_target(built_cache, chat_tokenizer):
    target, records, manifest, cache_dir = built_cache
    data = TargetCacheDataset(cache_dir)
    assert len(data) == manifest["num_samples"] == 11 and "r0003" not in data.ids
    assert manifest["target_layer_ids"] == LAYERS and manifest["hidden_size"] == 64 and manifest["max_length"] == 64
    assert manifest["num_tokens"] == sum(data.lengths)
    i = data.ids.index("r0009")
    item = data[i]
    sample = tokenize_conversation(chat_tokenizer, records[9]["messages"], max_length=64)
    assert item["input_ids"].tolist() == sample.input_ids and item["loss_mask"].tolist() == sample.loss_mask
    with torch.no_grad():
        out = target(torch.tensor([sample.input_ids]), output_hidden_states=True)
    expected = torch.cat([out.hidden_states[k + 1][0] for k in LAYERS], dim=-1)  # raw outputs of layers 1, 2
    assert torch.allclose(item["target_hidden_states"], expected, atol=1e-4)
    assert torch.allclose(item["target_last_hidden_states"], out.hidden_states[-1][0], atol=1e-4)  # post-norm
    # the final hidden state reproduces the target's logits through its LM head
    assert torch.allclose(target.lm_head(item["target_last_hidden_states"]), out.logits[0], atol=1e-3)


def test_cache_resume_appends_only_new_samples(tmp_path, chat_tokenizer):
    target = make_tiny_llama(num_layers=4)
    records = make_chat_records(10)
    kwargs = {"layer_ids": LAYERS, "max_length": 64, "batch_size": 3, "progress": False, "shard_size_mb": 1}
    first = build_target_cache(target, chat_tokenizer, records[:6], tmp_path, **kwargs)
    assert first["num_samples"] == 6 and first["dtype"] == "bfloat16"
    second = build_target_cache(target, chat_tokenizer, records, tmp_path, **kwargs)
    assert second["num_samples"] == 10 and len(second["shards"]) == 2
    assert second["shards"][1]["num_samples"] == 4
    data = TargetCacheDataset(tmp_path)
    assert sorted(data.ids) == [r["id"] for r in records]
    assert data[0]["target_hidden_states"].dtype == torch.bfloat16
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temporary files
    with pytest.raises(ValueError, match="max_length"):
        build_target_cache(target, chat_tokenizer, records, tmp_path, **{**kwargs, "max_length": 32})


def test_dataset_pickles_and_collates(built_cache):
    _, _, _, cache_dir = built_cache
    data = pickle.loads(pickle.dumps(TargetCacheDataset(cache_dir)))
    batch = collate_target_batch([data[0], data[1]])
    n0, n1 = data.lengths[0], data.lengths[1]
    assert batch["input_ids"].shape == (2, max(n0, n1))
    assert batch["attention_mask"].sum(1).tolist() == [n0, n1]
    assert batch["target_hidden_states"].shape == (2, max(n0, n1), 2 * 64)
    assert batch["loss_mask"][~batch["attention_mask"]].sum() == 0


def test_manifest_mismatch_is_refused(built_cache):
    target, _, manifest, cache_dir = built_cache
    good = DSparkDraftModel.from_target(target, target_layer_ids=LAYERS, markov_rank=8)
    validate_manifest(load_manifest(cache_dir), good.config)
    wrong_layers = DSparkDraftModel.from_target(target, target_layer_ids=[0, 1], markov_rank=8)
    with pytest.raises(ValueError, match="target_layer_ids"):
        validate_manifest(manifest, wrong_layers.config)
    other_family = DSparkDraftModel.from_target(make_tiny_qwen3(num_layers=4), target_layer_ids=LAYERS, markov_rank=8)
    with pytest.raises(ValueError, match="target_model_type"):
        validate_manifest(manifest, other_family.config)
    same_shapes = DSparkDraftModel.from_target(make_tiny_llama(seed=5, num_layers=4), target_layer_ids=LAYERS,
                                               markov_rank=8)
    with pytest.raises(ValueError, match="embedding weights differ"):
        validate_manifest(manifest, same_shapes.config)
    named = dict(manifest, target_name_or_path="org/TinyTarget")
    good.config.target_name_or_path = "/local/copy/TinyTarget/"
    validate_manifest(named, good.config)  # same model, other location
    good.config.target_name_or_path = "org/OtherTarget"
    with pytest.raises(ValueError, match="target_name_or_path"):
        validate_manifest(named, good.config)
    bad = json.loads((cache_dir / MANIFEST_NAME).read_text())
    bad["format_version"] = 99
    (cache_dir / MANIFEST_NAME).write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="not a target cache"):
        load_manifest(cache_dir)


def test_logsumexp_side_car_and_answer_token_counts(built_cache, tmp_path):
    import shutil

    from hf_dspark.training.draft_vocabulary import count_answer_tokens
    from hf_dspark.training.target_cache import write_target_logsumexp

    target, _, _, cache_dir = built_cache
    cache = tmp_path / "cache-copy"
    shutil.copytree(cache_dir, cache)
    draft = DSparkDraftModel.from_target(target, target_layer_ids=LAYERS, markov_rank=8)
    assert not TargetCacheDataset(cache).has_logsumexp
    assert write_target_logsumexp(cache, draft.compute_logits, batch_tokens=7, progress=False) == len(
        load_manifest(cache)["shards"])
    assert write_target_logsumexp(cache, draft.compute_logits, progress=False) == 0  # existing side-cars kept
    from hf_dspark.training.target_cache import target_logits_function

    compute_logits, head_dtype = target_logits_function(target)
    hidden = torch.randn(3, 64)
    assert head_dtype == torch.float32
    torch.testing.assert_close(compute_logits(hidden), draft.compute_logits(hidden))
    data = TargetCacheDataset(cache)
    assert data.has_logsumexp
    item = data[3]
    expected = torch.logsumexp(target.lm_head(item["target_last_hidden_states"].float()), -1)
    torch.testing.assert_close(item["target_logsumexp"], expected, rtol=1e-5, atol=1e-5)
    batch = collate_target_batch([data[0], data[1]])
    assert batch["target_logsumexp"].shape == batch["input_ids"].shape
    counts = count_answer_tokens(cache, target.config.vocab_size)
    expected_counts = torch.zeros(target.config.vocab_size, dtype=torch.long)
    for i in range(len(data)):
        expected_counts += torch.bincount(data[i]["input_ids"][data[i]["loss_mask"].bool()],
                                          minlength=target.config.vocab_size)
    assert torch.equal(counts, expected_counts)


# ---------------------------------------------------------------------------------------------------------
# Conversation files: what `hf-dspark cache --data` reads
# ---------------------------------------------------------------------------------------------------------
def _conversation_bytes(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


BAD_CONVERSATION_FILES = {  # name -> (file name, contents, message)
    "empty": ("train.jsonl", b"\n", "holds no conversations"),
    "a prompt file": ("prompts.jsonl", b'{"turns": ["Hi"]}\n', "record 1 (id None) has no 'messages' list"),
    "turns without content": ("train.jsonl", b'{"id": "a", "messages": [{"role": "user"}]}\n', "has no 'messages'"),
    "not a record": ("train.jsonl", b'["a", "b"]\n', "line 1: a JSON list, not a record"),
    "gzip named .jsonl": ("train.jsonl", gzip.compress(b'{"id": "a"}\n'), "is not UTF-8 text"),
    "truncated gzip": ("train.jsonl.gz", gzip.compress(_conversation_bytes(make_chat_records(4)))[:60],
                       "damaged gzip data"),
}


@pytest.mark.parametrize("case", list(BAD_CONVERSATION_FILES))
def test_a_conversation_file_that_cannot_be_cached_names_the_file_and_the_problem(case, tmp_path):
    """Such files raised KeyError / AttributeError / UnicodeDecodeError from inside the caching loop (after part
    of the data had been cached), and an empty file made a cache without conversations."""
    name, contents, message = BAD_CONVERSATION_FILES[case]
    path = tmp_path / name
    path.write_bytes(contents)
    with pytest.raises(ConversationFileError, match=re.escape(message)) as err:
        read_conversations(path)
    assert str(path) in str(err.value)


def test_conversation_files_may_be_gzipped_and_skip_an_interrupted_line(tmp_path, caplog):
    records = make_chat_records(3)
    lines = _conversation_bytes(records).splitlines(keepends=True)
    (tmp_path / "train.jsonl.gz").write_bytes(gzip.compress(b"".join([lines[0], b'{"id": "cut", "mess\n', *lines[1:]])))
    assert read_conversations(tmp_path / "train.jsonl.gz") == records
    assert "Skipping a damaged line 2" in caplog.text  # what an interrupted regeneration leaves; it regenerates it
