"""Numbers and lists on the ``hf-dspark`` command line (cli/arguments.py): a value out of range is one argparse
error line naming the option, exit code 2, before any model loads (it crashed with a traceback deep inside the
run, or ran and reported nothing)."""

from __future__ import annotations

import pytest

from hf_dspark import cli

BAD_VALUES = {
    "generate --max-new-tokens -3": (["generate", "--max-new-tokens", "-3"], "--max-new-tokens", ">= 1"),
    "generate --threads 0": (["generate", "--threads", "0"], "--threads", ">= 1"),
    "generate --temperature 0": (["generate", "--sample", "--temperature", "0"], "--temperature", "> 0"),
    "generate --top-p 2": (["generate", "--top-p", "2"], "--top-p", "in (0, 1]"),
    "bench --temperatures x": (["bench", "--temperatures", "x"], "--temperatures", "comma-separated"),
    "bench --temperatures -1": (["bench", "--temperatures", "0,-1"], "--temperatures", ">= 0"),
    "bench --per-benchmark 0": (["bench", "--per-benchmark", "0"], "--per-benchmark", ">= 1"),
    "bench --num-tokens -1": (["bench", "--num-tokens", "2,-1"], "--num-tokens", ">= 0"),
    "serve-bench --concurrency 0": (["serve-bench", "--concurrency", "1,0"], "--concurrency", ">= 1"),
    "serve-bench --concurrency x": (["serve-bench", "--concurrency", "1,x"], "--concurrency", "comma-separated"),
    "serve-bench --max-new-tokens 0": (["serve-bench", "--max-new-tokens", "0"], "--max-new-tokens", ">= 1"),
    "serve-bench --policies bogus": (["serve-bench", "--policies", "none,bogus"], "--policies", "'bogus'"),
    "eval --temperatures -1": (["eval", "--drafter", "d", "--out", "o", "--temperatures", "-1"], "--temperatures",
                               ">= 0"),
    "eval --max-samples 0": (["eval", "--drafter", "d", "--out", "o", "--max-samples", "0"], "--max-samples", ">= 1"),
    "calibrate --num-prompts -1": (["calibrate", "--drafter", "d", "--out", "o", "--num-prompts", "-1"],
                                   "--num-prompts", ">= 0"),
    "calibrate --batch-size 0": (["calibrate", "--drafter", "d", "--out", "o", "--batch-size", "0"], "--batch-size",
                                 ">= 1"),
    "regenerate --batch-size 0": (["regenerate", "--batch-size", "0"], "--batch-size", ">= 1"),
    "regenerate --num-magpie -1": (["regenerate", "--num-magpie", "-1"], "--num-magpie", ">= 0"),
    "cache --max-length 0": (["cache", "--max-length", "0", "--data", "a", "--out", "o"], "--max-length", ">= 1"),
    "train --steps 0": (["train", "--steps", "0"], "--steps", ">= 1"),
    "train --lr -1": (["train", "--steps", "1", "--lr", "-1"], "--lr", ">= 0"),  # 0 keeps the weights
    "train --block-size 0": (["train", "--steps", "1", "--block-size", "0"], "--block-size", ">= 1"),
    "train --warmup-ratio 1": (["train", "--steps", "1", "--warmup-ratio", "1"], "--warmup-ratio", "in [0, 1)"),
    "train --warmup-ratio -0.1": (["train", "--steps", "1", "--warmup-ratio", "-0.1"], "--warmup-ratio", "in [0, 1)"),
}


@pytest.fixture
def no_model_loading(monkeypatch):
    from hf_dspark import loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_target", refuse)
    monkeypatch.setattr(loading, "load_drafter", refuse)


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_value_out_of_range_is_one_argparse_error(case, no_model_loading, capsys):
    argv, option, rule = BAD_VALUES[case]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.rstrip().splitlines()[-1]
    assert line.startswith(f"hf-dspark {argv[0]}: error: argument {option}") and rule in line, line


def test_serve_bench_min_new_tokens_above_max_is_refused(no_model_loading, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve-bench", "--min-new-tokens", "64", "--max-new-tokens", "16"])
    assert exit_.value.code == 2
    assert "--min-new-tokens 64 is above --max-new-tokens 16" in capsys.readouterr().err


def test_values_in_range_parse_to_numbers_and_lists():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--temperatures", "0, 0.7", "--thresholds", "", "--num-tokens", "0,3"])
    assert args.temperatures == [0.0, 0.7] and args.thresholds == [] and args.num_tokens == [0, 3]
    args = parser.parse_args(["serve-bench", "--concurrency", "1,4", "--policies", "none,fixed1,lookup-only"])
    assert args.concurrency == [1, 4] and args.policies == ["none", "fixed1", "lookup-only"]
    args = parser.parse_args(["serve-bench"])  # the defaults go through the same parsing
    assert args.concurrency == [1, 2, 4, 8, 16, 32, 64] and "scheduled" in args.policies
    args = parser.parse_args(["calibrate", "--drafter", "d", "--out", "o", "--num-prompts", "0"])
    assert args.num_prompts == 0
    assert parser.parse_args(["train", "--save-total-limit", "0"]).save_total_limit == 0  # keep every checkpoint


OUTPUT_FOLDERS = {
    "regenerate --out": ["regenerate", "--out", "{file}"],
    "cache --out": ["cache", "--data", "{file}", "--out", "{file}"],
    "train --out": ["train", "--steps", "1", "--out", "{file}"],
    "train --cache": ["train", "--steps", "1", "--cache", "{file}"],
    "calibrate --out": ["calibrate", "--drafter", "d", "--out", "{file}"],
    "eval --out": ["eval", "--drafter", "d", "--out", "{file}"],
    "bench --out": ["bench", "--out", "{file}"],
    "serve-bench --out": ["serve-bench", "--out", "{file}"],
}


@pytest.mark.parametrize("case", list(OUTPUT_FOLDERS))
def test_an_output_folder_that_is_a_file_is_one_argparse_error(case, no_model_loading, tmp_path, capsys):
    """Such a path failed with FileExistsError (a traceback) when the first result was written: train after its
    first step, eval / bench / calibrate after the whole run, whose results were lost."""
    (tmp_path / "file").write_text("")
    argv = [arg.format(file=tmp_path / "file") for arg in OUTPUT_FOLDERS[case]]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    option = case.split()[1]
    assert err.rstrip().splitlines()[-1] == (f"hf-dspark {argv[0]}: error: argument {option}: "
                                             f"'{tmp_path / 'file'}' is a file: give a folder")
