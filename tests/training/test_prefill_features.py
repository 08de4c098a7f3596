"""Features computed while training equal the on-disk cache's, and train a drafter the same way."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch
from chat_data import make_chat_records, make_chat_tokenizer, single_thread  # noqa: F401
from conftest import make_tiny_llama

from hf_dspark import DSparkDraftModel
from hf_dspark.training.prefill_features import TargetPrefillDataset, chat_record_files, read_chat_records
from hf_dspark.training.target_cache import TargetCacheDataset, build_target_cache, write_target_logsumexp
from hf_dspark.training.trainer import DSparkTrainer, DSparkTrainingConfig, make_accelerator

LAYERS = [0, 2]


@pytest.fixture(scope="module")
def tokenizer():
    return make_chat_tokenizer()


def test_items_equal_the_cache_items(tmp_path, tokenizer, single_thread):
    target = make_tiny_llama(num_layers=4).eval()
    records = make_chat_records(6)
    build_target_cache(target, tokenizer, records, tmp_path / "cache", layer_ids=LAYERS, dtype="float32",
                       batch_size=1, progress=False)
    head = target.get_output_embeddings().weight

    write_target_logsumexp(tmp_path / "cache", lambda h: h @ head.T, progress=False)
    cached = TargetCacheDataset(tmp_path / "cache")
    live = TargetPrefillDataset(target, tokenizer, records, LAYERS, feature_dtype=torch.float32, logsumexp=True,
                                progress=False)
    assert live.ids == cached.ids and len(live) == len(cached) == 6
    for i in range(len(live)):
        a, b = live[i], cached[i]
        assert a.keys() == b.keys()
        for key in ("input_ids", "loss_mask"):
            assert torch.equal(a[key], b[key]), key
        for key in ("target_hidden_states", "target_last_hidden_states"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5)
        answer = b["loss_mask"].bool()
        torch.testing.assert_close(a["target_logsumexp"][answer], b["target_logsumexp"][answer])
    live.close()
    assert not any(layer._forward_hooks for layer in target.model.layers)  # the tap leaves nothing behind


def test_bf16_features_from_a_bf16_copy_train_a_drafter(tmp_path, tokenizer, single_thread):
    target = make_tiny_llama(num_layers=4).eval()
    copy = make_tiny_llama(num_layers=4).to(torch.bfloat16).eval()
    data = TargetPrefillDataset(target, tokenizer, make_chat_records(8), LAYERS, feature_target=copy,
                                progress=False)
    item = data[0]
    assert item["target_hidden_states"].dtype == torch.bfloat16
    assert not item["target_hidden_states"].is_inference()  # autograd may save it for the drafter's backward
    torch.manual_seed(0)
    drafter = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8, target_layer_ids=LAYERS)
    config = DSparkTrainingConfig(output_dir=str(tmp_path / "run"), max_steps=100, per_device_batch_size=2,
                                  gradient_accumulation_steps=1, num_anchors=8, schedule="constant", warmup_steps=2,
                                  progress=False)
    trainer = DSparkTrainer(drafter, data, config, accelerator=make_accelerator("no"))
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    stats, info = trainer.training_step()
    assert info["num_tokens"] > 0 and stats.summary(config.loss)["loss"] > 0
    assert any(not torch.equal(before[n], p) for n, p in drafter.named_parameters())


def test_a_bf16_autocast_step_trains_like_fp32_after_an_fp32_trainer_in_the_same_process(tmp_path, tokenizer,
                                                                                          single_thread):
    # accelerate keeps one process-wide precision; a bf16 cool-down after an fp32 run (or a test after another) must
    # still get the precision it asks for, and the bf16 step's loss stays the fp32 step's within bf16 rounding
    target = make_tiny_llama(num_layers=4).eval()
    data = TargetPrefillDataset(target, tokenizer, make_chat_records(8), LAYERS, progress=False)
    losses = {}
    for precision in ("no", "bf16", "no"):
        torch.manual_seed(0)
        drafter = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8,
                                               target_layer_ids=LAYERS)
        config = DSparkTrainingConfig(output_dir=str(tmp_path / precision), max_steps=10, per_device_batch_size=2,
                                      num_anchors=8, schedule="constant", warmup_steps=1, progress=False)
        trainer = DSparkTrainer(drafter, data, config, accelerator=make_accelerator(precision))
        assert trainer.accelerator.mixed_precision == precision
        matmul_dtypes = set()
        hooks = [m.register_forward_hook(lambda m, i, o: matmul_dtypes.add(o.dtype))
                 for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
        stats, _ = trainer.training_step()
        for hook in hooks:
            hook.remove()
        assert matmul_dtypes == {torch.bfloat16 if precision == "bf16" else torch.float32}
        assert all(p.dtype == torch.float32 for p in drafter.parameters())  # fp32 master weights
        losses.setdefault(precision, []).append(stats.summary(config.loss)["loss"])
    assert losses["no"][0] == losses["no"][1]
    assert losses["bf16"][0] == pytest.approx(losses["no"][0], rel=0.02)


def test_the_continuous_run_picks_bf16_steps_only_where_the_cpu_has_bf16_units(monkeypatch):
    import hf_dspark.cpu_kernels as cpu_kernels
    from hf_dspark.training.continuous import ContinuousRecipe, step_precision

    recipe = ContinuousRecipe(data=[], heldout_cache="", run_dir="", best_dir="", curve_file="")
    assert recipe.lr == 1e-4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for units, expected in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(cpu_kernels, "cpu_has_bf16_units", lambda units=units: units)
        assert step_precision(recipe.mixed_precision) == expected
    assert step_precision("no") == "no"


def test_the_continuous_run_prefills_in_bf16_only_where_that_is_faster(monkeypatch):
    """A CPU without bf16 units emulates a bf16 prefill many times slower than fp32's: "auto" keeps fp32 there."""
    import hf_dspark.cpu_kernels as cpu_kernels
    from hf_dspark.training.continuous import ContinuousRecipe, feature_target_for, prefills_in_bf16

    target = make_tiny_llama(num_layers=2).eval()
    recipe = ContinuousRecipe(data=[], heldout_cache="", run_dir="", best_dir="", curve_file="")
    assert recipe.bf16_features is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for units in (True, False):
        monkeypatch.setattr(cpu_kernels, "cpu_has_bf16_units", lambda units=units: units)
        assert prefills_in_bf16(recipe.bf16_features) is units
        prefilling = feature_target_for(target, recipe)
        assert next(prefilling.parameters()).dtype == (torch.bfloat16 if units else torch.float32)
        assert prefills_in_bf16(False) is False and prefills_in_bf16(True) is True
    assert next(target.parameters()).dtype == torch.float32  # the target itself is never cast


def test_constant_schedule_holds_the_rate_after_warm_up():
    config = DSparkTrainingConfig(output_dir="x", max_steps=10**9, schedule="constant", warmup_steps=4)
    assert [config.lr_factor(s) for s in (0, 3, 4, 10**6)] == [0.25, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="schedule='linear'"):
        DSparkTrainingConfig(output_dir="x", schedule="linear")


def test_chat_records_from_plain_gzip_and_globs_skip_a_line_still_being_written(tmp_path):
    records = make_chat_records(4)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:2]) + '{"id": "r9", "mess')
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records[1:])  # r0001 twice: kept once
    files = chat_record_files([tmp_path / "a.jsonl", str(tmp_path / "*.gz")])
    assert [f.name for f in files] == ["a.jsonl", "b.jsonl.gz"]
    assert [r["id"] for r in read_chat_records(files)] == ["r0000", "r0001", "r0002", "r0003"]
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        chat_record_files([tmp_path / "missing.jsonl"])


def test_chat_records_skip_a_damaged_line_and_name_a_file_that_is_not_conversations(tmp_path, caplog):
    from hf_dspark.training.target_cache import ConversationFileError

    records = make_chat_records(3)
    lines = [json.dumps(r) + "\n" for r in records]
    (tmp_path / "a.jsonl").write_text(lines[0] + '{"id": "r9", "mess\n' + lines[1] + lines[2])
    assert [r["id"] for r in read_chat_records([tmp_path / "a.jsonl"])] == ["r0000", "r0001", "r0002"]
    assert "damaged line 2" in caplog.text
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"turns": ["Hi"]}) + "\n")  # a prompt file passed as data
    with pytest.raises(ConversationFileError, match=r"prompts.jsonl: record 1 .*no 'messages'"):
        read_chat_records([tmp_path / "prompts.jsonl"])
    (tmp_path / "latin1.jsonl").write_bytes(lines[0].replace("r0000", "r\u00e9").encode("latin-1"))
    with pytest.raises(ConversationFileError, match="not UTF-8"):
        read_chat_records([tmp_path / "latin1.jsonl"])


def _heldout_cache(target, tokenizer, path):
    records = make_chat_records(4, seed=7)
    for i, record in enumerate(records):
        record["id"] = f"heldout-{'code' if i % 2 else 'chat'}-{i:02d}"
    build_target_cache(target, tokenizer, records, path, layer_ids=LAYERS, progress=False)


def test_continuous_run_writes_its_curve_and_best_drafter_and_continues_from_them(tmp_path, tokenizer, single_thread):
    from hf_dspark.training.continuous import ContinuousRecipe, best_row, read_curve, train_continuously

    target = make_tiny_llama(num_layers=4).eval()
    torch.manual_seed(0)
    legacy = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8, target_layer_ids=LAYERS,
                                          draft_layer_style="target")
    legacy.save_pretrained(tmp_path / "legacy")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_chat_records(12)))
    _heldout_cache(target, tokenizer, tmp_path / "heldout")
    recipe = ContinuousRecipe(data=[str(data)], heldout_cache=str(tmp_path / "heldout"), run_dir=str(tmp_path / "run"),
                              best_dir=str(tmp_path / "best"), curve_file=str(tmp_path / "curve.jsonl"),
                              init_from=str(tmp_path / "legacy"), num_layers=2, eval_every=3, max_evaluations=2,
                              lr=3e-3, batch_size=2, num_anchors=8, bf16_features=False, mixed_precision="no",
                              session="s1")
    rows = train_continuously(target, tokenizer, recipe)
    curve = read_curve(recipe.curve_file)
    assert curve == rows and [r["step"] for r in rows] == [0, 3, 6]  # the starting point, then every 3 steps
    assert rows[0]["train_tokens"] == 0 < rows[1]["train_tokens"] < rows[2]["train_tokens"]
    assert set(rows[1]["heldout"]) == {"chat", "code"}
    assert rows[1]["lr"] == 3e-3 and rows[1]["precision"] == "no" and rows[1]["num_anchors"] == 8
    assert rows[1]["sequential_top_k"] == legacy.config.sequential_top_k
    best = json.loads((tmp_path / "best" / "config.json").read_text())
    assert best["draft_layer_style"] == "qwen3" and best["num_hidden_layers"] == 2 and best["dtype"] == "bfloat16"
    from safetensors import safe_open
    with safe_open(str(tmp_path / "best" / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys() if f.get_tensor(k).is_floating_point()} == {torch.bfloat16}
    # the next session continues from the committed drafter and the token count of the row it was written at
    extra = [{**r, "id": f"new{i}"} for i, r in enumerate(make_chat_records(4, seed=3))]
    data.write_text(data.read_text() + "".join(json.dumps(r) + "\n" for r in extra))
    next_session = ContinuousRecipe(**{**recipe.__dict__, "run_dir": str(tmp_path / "run2"), "init_from": None,
                                       "max_evaluations": 1, "session": "s2"})
    from hf_dspark.training import continuous

    rows[0]["heldout"] = {k: {**v, "tau_greedy": 0.0} for k, v in rows[0]["heldout"].items()}  # a trained row is best
    Path(recipe.curve_file).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert best_row(rows)["train_tokens"] > 0
    seeds = []
    real_trainer = continuous.DSparkTrainer

    def recording_trainer(drafter, dataset, config, accelerator=None):
        seeds.append(config.seed)
        return real_trainer(drafter, dataset, config, accelerator=accelerator)

    continuous.DSparkTrainer = recording_trainer
    try:
        more = train_continuously(target, tokenizer, next_session)
    finally:
        continuous.DSparkTrainer = real_trainer
    # a new session does not replay the last one's sample order: it is seeded by the tokens the run has seen
    assert seeds == [best_row(rows)["train_tokens"]]
    assert len(more) == 1 and more[0]["session"] == "s2"
    assert more[0]["train_tokens"] > best_row(rows)["train_tokens"]
    assert more[0]["samples"] == 16


def test_cool_down_scores_a_decayed_copy_and_leaves_the_run_as_it_was(tmp_path, tokenizer, single_thread):
    from hf_dspark.training.continuous import ContinuousRecipe, cool_down, read_curve, train_continuously

    target = make_tiny_llama(num_layers=4).eval()
    torch.manual_seed(0)
    DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=8, target_layer_ids=LAYERS
                                 ).save_pretrained(tmp_path / "init")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_chat_records(12)))
    _heldout_cache(target, tokenizer, tmp_path / "heldout")
    recipe = ContinuousRecipe(data=[str(data)], heldout_cache=str(tmp_path / "heldout"), run_dir=str(tmp_path / "run"),
                              best_dir=str(tmp_path / "best"), curve_file=str(tmp_path / "curve.jsonl"),
                              init_from=str(tmp_path / "init"), eval_every=3, max_evaluations=1, lr=3e-3,
                              batch_size=2, num_anchors=8, bf16_features=False, session="s1")
    run_rows = train_continuously(target, tokenizer, recipe)
    checkpoint = tmp_path / "run" / (tmp_path / "run" / "latest").read_text().strip()
    weights_before = (checkpoint / "model.safetensors").read_bytes()
    progress = json.loads((tmp_path / "run" / "progress.json").read_text())
    # a cooled copy that scores below the best row must not replace the committed drafter
    best_before = (tmp_path / "best" / "model.safetensors").read_bytes()
    with open(recipe.curve_file, "a") as f:  # an unbeatable earlier row
        f.write(json.dumps({**run_rows[-1], "heldout": {k: {**v, "tau_greedy": 99.0}
                                                        for k, v in run_rows[-1]["heldout"].items()}}) + "\n")
    row = cool_down(target, tokenizer, recipe, steps=4, warmup_steps=1)
    assert read_curve(recipe.curve_file)[-1] == row and row["cool_down_steps"] == 4
    assert row["step"] == progress["step"] == 3 and row["train_tokens"] > progress["train_tokens"]
    assert (tmp_path / "best" / "model.safetensors").read_bytes() == best_before
    assert (checkpoint / "model.safetensors").read_bytes() == weights_before  # the run goes on uncooled
    # once every earlier row scores below it, the cooled copy is the best yet and ships
    Path(recipe.curve_file).write_text("".join(
        json.dumps({**r, "heldout": {k: {**v, "tau_greedy": 0.0} for k, v in r["heldout"].items()}}) + "\n"
        for r in read_curve(recipe.curve_file)))
    again = cool_down(target, tokenizer, recipe, steps=2, warmup_steps=1)
    assert (tmp_path / "best" / "model.safetensors").read_bytes() != best_before
    shipped = DSparkDraftModel.from_pretrained(tmp_path / "best", target=target)
    assert shipped.config.dtype in ("bfloat16", torch.bfloat16) and again["cool_down_steps"] == 2


def test_heldout_answers_are_generated_once_then_read_from_the_committed_file(tmp_path, tokenizer, single_thread,
                                                                             monkeypatch):
    from hf_dspark.training import validation

    target = make_tiny_llama(num_layers=2).eval()
    prompts = [{"id": f"heldout-chat-{i}", "turns": [r["messages"][0]["content"]]}
               for i, r in enumerate(make_chat_records(3, seed=5))]
    answers = tmp_path / "answers.jsonl"
    first = validation.stored_greedy_answer_records(target, tokenizer, prompts[:2], answers, max_new_tokens=6)
    assert [r["id"] for r in first] == ["heldout-chat-0", "heldout-chat-1"]
    assert first == validation.greedy_answer_records(target, tokenizer, prompts[:2], max_new_tokens=6)
    asked = []
    real = validation.greedy_answer_records
    monkeypatch.setattr(validation, "greedy_answer_records",
                        lambda t, tok, ps, **kw: asked.append([p["id"] for p in ps]) or real(t, tok, ps, **kw))
    again = validation.stored_greedy_answer_records(target, tokenizer, prompts, answers, max_new_tokens=6)
    assert asked == [["heldout-chat-2"]]  # only the prompt the file lacked was answered
    assert again[:2] == first and [r["id"] for r in again] == [p["id"] for p in prompts]
    assert len(answers.read_text().splitlines()) == 3


def test_train_continuous_leaves_the_prefill_precision_to_the_hardware_unless_told():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from test_wrappers import load_script

    script = load_script("train_continuous")
    assert script.parse_args([]).bf16_features is None
    assert script.parse_args(["--bf16-features"]).bf16_features is True
    assert script.parse_args(["--no-bf16-features"]).bf16_features is False
    with pytest.raises(SystemExit):
        script.parse_args(["--bf16-features", "--no-bf16-features"])
