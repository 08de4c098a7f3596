"""The ``hf-dspark`` command line: help everywhere, real convert / push / generate runs on tiny models, and the
pass-through of script-backed commands (scripts replaced by recorders, so nothing long runs)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import TINY_VOCAB, make_tiny_llama, make_tiny_qwen3
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_dspark import DSparkDraftModel, cli

ALL_COMMANDS = ["generate", "train", "convert", "push", "regenerate", "bench", "eval", "calibrate", "serve-bench"]


def run(argv: list[str]) -> int:
    """main() as the console script runs it: SystemExit becomes its code."""
    try:
        return cli.main(argv)
    except SystemExit as exit_:
        return 0 if exit_.code is None else exit_.code


@pytest.mark.parametrize("command", ALL_COMMANDS)
def test_every_command_has_help(command, capsys):
    assert run([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage:" in out.lower()


def test_top_level_help_lists_every_command(capsys):
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ALL_COMMANDS:
        assert command in out
    assert run([]) == 0  # no command: help, not a traceback


def test_unknown_option_of_an_own_command_is_an_error(capsys):
    assert run(["convert", "a", "b", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------------
# convert / push on real tiny drafters
# -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_drafter_dir(tmp_path_factory):
    target = make_tiny_qwen3()
    target.name_or_path = "Qwen/Qwen3-0.6B"
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, num_layers=1, block_size=4, markov_rank=16)
    path = tmp_path_factory.mktemp("qwen3_drafter")
    draft.save_pretrained(path)
    return path, draft


def test_convert_round_trip_through_the_cli(qwen3_drafter_dir, tmp_path, capsys):
    src, draft = qwen3_drafter_dir
    assert run(["convert", str(src), str(tmp_path / "spec"), "--to", "speculators"]) == 0
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["speculators_model_type"] == "dspark"
    assert run(["convert", str(tmp_path / "spec"), str(tmp_path / "back"), "--to", "native"]) == 0
    back = load_file(tmp_path / "back" / "model.safetensors")
    for name, tensor in draft.state_dict().items():
        assert torch.equal(back[name], tensor), name
    assert "Wrote a native-format drafter" in capsys.readouterr().out


def test_convert_refusal_is_a_clean_error(tmp_path, capsys):
    DSparkDraftModel.from_target(make_tiny_llama(), num_layers=1, block_size=4, markov_rank=16).save_pretrained(
        tmp_path / "llama")
    assert run(["convert", str(tmp_path / "llama"), str(tmp_path / "out")]) == 2
    assert "cannot be exported to the speculators format" in capsys.readouterr().err


def test_push_dry_run_writes_the_upload(qwen3_drafter_dir, tmp_path):
    src, _ = qwen3_drafter_dir
    (tmp_path / "eval.json").write_text(json.dumps({"gsm8k": {"tau": 2.75}}))
    assert run(["push", str(src), "org/tiny", "--eval-results", str(tmp_path / "eval.json"), "--license",
                "apache-2.0", "--dry-run", str(tmp_path / "upload")]) == 0
    assert {p.name for p in (tmp_path / "upload").iterdir()} == {"config.json", "model.safetensors", "README.md"}
    card = (tmp_path / "upload" / "README.md").read_text()
    assert "base_model: Qwen/Qwen3-0.6B" in card and "| gsm8k | 2.75 |" in card and "license: apache-2.0" in card


# -------------------------------------------------------------------------------------------------------
# generate on a tiny target saved with a tokenizer
# -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    target = make_tiny_llama()
    target.save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(path)
    torch.manual_seed(1)
    DSparkDraftModel.from_target(target, num_layers=1, block_size=5, markov_rank=16).save_pretrained(path / "drafter")
    prompt = "w5 w17 w33 w8"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          pad_token_id=0)
    return path, prompt, tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("mode", [["--drafter", "{path}/drafter"], ["--no-draft"]], ids=["drafter", "plain"])
def test_generate_prompt_streams_the_targets_greedy_text_and_reports_speed(tiny_target_dir, capsys, mode):
    path, prompt, expected = tiny_target_dir
    argv = ["generate", "--target", str(path), "--prompt", prompt, "--max-new-tokens", "12"]
    assert run(argv + [m.format(path=path) for m in mode]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == expected.strip() and expected.strip()
    assert "tok/s" in captured.err
    assert ("tau" in captured.err) == (mode[0] == "--drafter")


def test_generate_without_a_drafter_warns_and_stays_exact(tiny_target_dir, capsys, caplog):
    path, prompt, expected = tiny_target_dir
    with caplog.at_level(logging.WARNING, logger="hf_dspark.cli"):
        assert run(["generate", "--target", str(path), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    assert "UNTRAINED drafter" in caplog.text
    assert capsys.readouterr().out.strip() == expected.strip()


# -------------------------------------------------------------------------------------------------------
# script-backed commands
# -------------------------------------------------------------------------------------------------------
def test_script_commands_pass_every_option_through(tmp_path, monkeypatch):
    record = tmp_path / "argv.json"
    (tmp_path / "eval_drafter.py").write_text(
        "import json, sys\n"
        f"def main(argv=None):\n    open({str(record)!r}, 'w').write(json.dumps(argv))\n")
    (tmp_path / "bench_serving.py").write_text(  # a script whose main() reads sys.argv
        "import json, sys\n"
        f"def main():\n    open({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    monkeypatch.setattr(cli, "SCRIPTS_DIR", tmp_path)
    assert run(["eval", "--drafter", "d", "--benchmarks", "gsm8k", "alpaca", "-n", "3"]) == 0
    assert json.loads(record.read_text()) == ["--drafter", "d", "--benchmarks", "gsm8k", "alpaca", "-n", "3"]
    assert run(["serve-bench", "--concurrency", "1", "8"]) == 0
    assert json.loads(record.read_text()) == ["--concurrency", "1", "8"]


def test_missing_script_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "SCRIPTS_DIR", tmp_path)
    with pytest.raises(SystemExit, match="bench_generate.py is not available"):
        cli.main(["bench", "--batch-size", "4"])


def test_train_builds_the_cache_then_trains(monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "run_script", lambda name, argv, prog=None: calls.append((name, argv)) or 0)
    assert run(["train", "--data", "a.jsonl", "b.jsonl", "--cache", "c", "--out", "o", "--steps", "10",
                "--head", "gated"]) == 0
    assert calls == [("build_target_cache", ["--data", "a.jsonl", "b.jsonl", "--out", "c"]),
                     ("train_drafter", ["--cache", "c", "--out", "o", "--steps", "10", "--head", "gated"])]
    calls.clear()
    assert run(["train", "--epochs", "1"]) == 0  # no --data: train on the existing default cache
    assert calls == [("train_drafter", ["--cache", "cache/smollm2", "--out", "runs/smollm2-dspark", "--epochs", "1"])]


def test_convert_check_reports_without_converting(qwen3_drafter_dir, tmp_path, capsys):
    src, _ = qwen3_drafter_dir
    assert run(["convert", "--check", str(src)]) == 0
    out = capsys.readouterr().out
    for label in ("dialect", "architecture", "heads", "vocabulary", "taps", "block", "drafting", "loads", "exports"):
        assert f"  {label} " in out, label
    assert "native" in out and "DeepSpec (the anchor slot predicts)" in out and "to speculators / vLLM" in out
    assert not any(tmp_path.iterdir())


def test_convert_check_names_the_refusal(tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["X"]}))
    assert run(["convert", "--check", str(tmp_path / "bad")]) == 1
    assert "REFUSED: " in capsys.readouterr().out


def test_convert_needs_a_destination(qwen3_drafter_dir, capsys):
    src, _ = qwen3_drafter_dir
    assert run(["convert", str(src)]) == 2
    assert "DST is required" in capsys.readouterr().err
