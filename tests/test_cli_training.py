"""``hf-dspark cache`` / ``train`` / ``calibrate`` / ``regenerate`` on tiny saved targets: the mistakes a user makes
with them (a cache or drafter of another target, a run folder already used, an empty cache, a drafter with nothing
to calibrate, a damaged target, a mistyped path) are one error line with exit code 2, not a traceback."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_VOCAB, make_tiny_llama, make_tiny_qwen3
from test_cli import _one_line_error, run

from hf_dspark import DSparkDraftModel

CHAT_TEMPLATE = ("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
                 "{% if add_generation_prompt %}w5{% endif %}")


def _save_target(model, path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny Llama and Qwen3 targets with chat templates, a conversation file and the Llama's target cache."""
    root = tmp_path_factory.mktemp("cli_training")
    llama = _save_target(make_tiny_llama(), root / "llama")
    _save_target(make_tiny_qwen3(), root / "qwen3")
    data = root / "train.jsonl"
    words = [f"w{6 + (i * 7) % 80}" for i in range(40)]
    data.write_text("".join(json.dumps({"id": str(i), "messages": [
        {"role": "user", "content": f"w{10 + i} w11 w12"},
        {"role": "assistant", "content": " ".join(words[i:] + words[:i])}]}) + "\n" for i in range(3)))
    assert run(["cache", "--target", str(llama), "--data", str(data), "--out", str(root / "cache"), "--threads",
                "1"]) == 0
    return root


def test_training_on_a_cache_of_another_target_is_one_error_line(saved, tmp_path, capsys):
    assert run(["train", "--target", str(saved / "qwen3"), "--cache", str(saved / "cache"), "--out",
                str(tmp_path / "run"), "--steps", "1", "--threads", "1"]) == 2
    assert "Target cache mismatch" in _one_line_error(capsys, "train")


def test_extending_a_cache_with_another_target_is_one_error_line(saved, capsys):
    assert run(["cache", "--target", str(saved / "qwen3"), "--data", str(saved / "train.jsonl"), "--out",
                str(saved / "cache"), "--threads", "1"]) == 2
    assert "was built with target_model_type='llama'" in _one_line_error(capsys, "cache")


def test_training_on_an_empty_cache_is_one_error_line(saved, tmp_path, capsys):
    assert run(["cache", "--target", str(saved / "llama"), "--data", str(saved / "train.jsonl"), "--out",
                str(tmp_path / "empty"), "--min-loss-tokens", "1000", "--threads", "1"]) == 0
    capsys.readouterr()
    assert run(["train", "--target", str(saved / "llama"), "--cache", str(tmp_path / "empty"), "--out",
                str(tmp_path / "run"), "--steps", "1", "--threads", "1"]) == 2
    assert f"the target cache {tmp_path / 'empty'} holds no conversations" in _one_line_error(capsys, "train")


def test_training_again_into_a_used_run_folder_is_one_error_line(saved, tmp_path, capsys):
    argv = ["train", "--target", str(saved / "llama"), "--cache", str(saved / "cache"), "--out", str(tmp_path / "run"),
            "--steps", "1", "--grad-accum", "1", "--block-size", "4", "--markov-rank", "8", "--threads", "1",
            "--no-progress"]
    assert run(argv) == 0
    capsys.readouterr()
    assert run(argv) == 2
    assert "already holds checkpoints: resume from them (--resume)" in _one_line_error(capsys, "train")
    assert run(argv[:argv.index("--grad-accum")] + ["--grad-accum", "2"] + argv[argv.index("--block-size"):]
               + ["--resume"]) == 2
    assert "Cannot resume exactly" in _one_line_error(capsys, "train")


def test_continuing_a_drafter_of_another_target_is_one_error_line(saved, tmp_path, capsys):
    DSparkDraftModel.from_target(make_tiny_qwen3(), num_layers=1, block_size=4, markov_rank=8).save_pretrained(
        tmp_path / "qwen3-drafter")
    assert run(["train", "--target", str(saved / "llama"), "--cache", str(saved / "cache"), "--out",
                str(tmp_path / "run"), "--steps", "1", "--threads", "1", "--init-from",
                str(tmp_path / "qwen3-drafter")]) == 2
    err = _one_line_error(capsys, "train")
    assert "cannot use the drafter" in err and "model_type=qwen3" in err


def test_calibrating_a_drafter_without_a_confidence_head_is_one_error_line(saved, tmp_path, capsys):
    torch.manual_seed(0)
    DSparkDraftModel.from_target(make_tiny_llama(), num_layers=1, block_size=4, head="none").save_pretrained(
        tmp_path / "dflash")
    assert run(["calibrate", "--target", str(saved / "llama"), "--drafter", str(tmp_path / "dflash"), "--out",
                str(tmp_path / "out"), "--prompts", str(saved / "train.jsonl"), "--threads", "1"]) == 2
    assert "has no confidence head" in _one_line_error(capsys, "calibrate")
    assert not (tmp_path / "out").exists()


def test_a_target_with_damaged_weights_is_one_error_line(saved, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for source in (saved / "llama").iterdir():
        (damaged / source.name).write_bytes(source.read_bytes())
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    assert run(["generate", "--target", str(damaged), "--no-draft", "--prompt", "w5", "--threads", "1"]) == 2
    assert f"cannot load the target '{damaged}'" in _one_line_error(capsys, "generate")


@pytest.fixture
def no_target_loading(monkeypatch):
    from hf_dspark import loading

    def load_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the paths were checked")

    monkeypatch.setattr(loading, "load_target", load_target)


@pytest.mark.parametrize("command", ["regenerate", "cache", "train"])
def test_a_missing_target_path_fails_before_loading(command, no_target_loading, tmp_path, capsys):
    argv = {"regenerate": ["regenerate", "--out", str(tmp_path / "out")],
            "cache": ["cache", "--data", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "out")],
            "train": ["train", "--steps", "1", "--out", str(tmp_path / "out")]}[command]
    (tmp_path / "a.jsonl").write_text("")
    assert run(argv + ["--target", str(tmp_path / "no-such-model")]) == 2
    err = _one_line_error(capsys, command)
    assert f"cannot load the target '{tmp_path / 'no-such-model'}': no such file or directory." in err


@pytest.mark.parametrize("command", ["regenerate --prompts", "cache --data", "train --data", "calibrate --prompts",
                                     "train --init-from"])
def test_a_missing_input_file_fails_before_loading(command, no_target_loading, tmp_path, capsys):
    name, option = command.split()
    argv = {"regenerate": ["regenerate", "--out", str(tmp_path / "out")],
            "cache": ["cache", "--out", str(tmp_path / "out")],
            "train": ["train", "--steps", "1", "--out", str(tmp_path / "out")],
            "calibrate": ["calibrate", "--drafter", str(tmp_path), "--out", str(tmp_path / "out")]}[name]
    (tmp_path / "config.json").write_text("{}")  # calibrate's --drafter is a model folder: only --prompts is missing
    assert run(argv + [option, str(tmp_path / "missing")]) == 2
    err = _one_line_error(capsys, name)
    assert str(tmp_path / "missing") in err and ("no such file" in err or "no such file or directory" in err)


@pytest.mark.parametrize("command", ["regenerate", "calibrate"])
def test_prompts_overlapping_the_evaluation_sets_are_one_error_line(command, saved, tmp_path, capsys):
    question = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "gsm8k.jsonl").write_text(json.dumps({"turns": [question]}) + "\n")
    (tmp_path / "mine.jsonl").write_text(json.dumps({"turns": [question]}) + "\n")
    common = ["--target", str(saved / "llama"), "--eval-dir", str(tmp_path / "eval"), "--threads", "1"]
    torch.manual_seed(0)
    DSparkDraftModel.from_target(make_tiny_llama(), num_layers=1, block_size=4).save_pretrained(tmp_path / "drafter")
    argv = {"regenerate": ["regenerate", "--out", str(tmp_path / "out"), "--prompts", str(tmp_path / "mine.jsonl"),
                           "--num-template", "0", "--num-magpie", "0"],
            "calibrate": ["calibrate", "--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "out"),
                          "--prompts", str(tmp_path / "mine.jsonl")]}[command]
    assert run(argv + common) == 2
    assert "overlap the evaluation sets" in _one_line_error(capsys, command)


def test_a_prompt_file_given_as_conversations_is_one_error_line(saved, tmp_path, capsys):
    """A record without messages raised KeyError from inside the caching loop, after the earlier files were cached."""
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"turns": ["w5 w6"]}) + "\n")
    assert run(["cache", "--target", str(saved / "llama"), "--data", str(saved / "train.jsonl"),
                str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / "cache"), "--threads", "1"]) == 2
    err = _one_line_error(capsys, "cache")
    assert f"{tmp_path / 'prompts.jsonl'}: record 1 (id None) has no 'messages' list" in err
    assert not (tmp_path / "cache").exists()  # checked before the target ran over the first file


@pytest.mark.parametrize("contents", ["", '{"turns": ["w5"]}\n{"turns": ["w6"\n'], ids=["empty", "damaged line"])
def test_calibration_prompts_that_cannot_be_used_fail_before_loading(contents, no_target_loading, tmp_path, capsys):
    """An empty prompt file raised ValueError (a traceback) after the target had loaded, a damaged line a bare
    JSONDecodeError that named neither the file nor the line."""
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text(contents)
    assert run(["calibrate", "--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "out"), "--prompts",
                str(tmp_path / "prompts.jsonl")]) == 2
    err = _one_line_error(capsys, "calibrate")
    assert str(tmp_path / "prompts.jsonl") in err and ("holds no prompts" in err or ":2: not valid JSON" in err)


@pytest.mark.parametrize("option", ["cache --layers", "train --layers", "train --draft-vocab-size"])
def test_options_beyond_the_target_are_one_error_line_before_caching(option, saved, tmp_path, capsys):
    """--layers past the target's last layer raised a ValueError traceback; a --draft-vocab-size above the target's
    vocabulary did so after train --data had cached every conversation."""
    command, name = option.split()
    argv = [command, "--target", str(saved / "llama"), "--data", str(saved / "train.jsonl"), "--threads", "1",
            *(["--out", str(tmp_path / "cache")] if command == "cache" else
              ["--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "run"), "--steps", "1"])]
    argv += ["--layers", "1", "4"] if name == "--layers" else ["--draft-vocab-size", "97"]
    assert run(argv) == 2
    if name == "--layers":
        assert "Cannot tap layer 4: the target has 4 layers, 0 to 3." in _one_line_error(capsys, command)
    else:
        assert capsys.readouterr().err.rstrip().splitlines()[-1] == (
            "hf-dspark train: error: argument --draft-vocab-size: must be at most the target's vocabulary of 96 "
            "tokens, got 97")
    assert not (tmp_path / "cache").exists()


def test_growing_a_drafter_to_fewer_layers_is_an_argparse_error(saved, tmp_path, capsys):
    """It raised "Cannot shrink a drafter" as a ValueError traceback, with --data after the cache had been built."""
    torch.manual_seed(0)
    DSparkDraftModel.from_target(make_tiny_llama(), num_layers=2, block_size=4, markov_rank=8).save_pretrained(
        tmp_path / "drafter")
    assert run(["train", "--target", str(saved / "llama"), "--cache", str(saved / "cache"), "--out",
                str(tmp_path / "run"), "--steps", "1", "--threads", "1", "--init-from", str(tmp_path / "drafter"),
                "--grow-to-layers", "1"]) == 2
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == (
        f"hf-dspark train: error: argument --grow-to-layers: the drafter {tmp_path / 'drafter'} already has 2 layers "
        "(a drafter grows, it is not cut), got 1")
    assert not (tmp_path / "run").exists()
