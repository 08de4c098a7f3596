"""The scripts that ship a drafter: calibration prompts it never saw (``unseen_prompts.py``), a stored fit scored on
rounds recorded elsewhere (``score_calibration.py``) and the card's summary of a continuous run
(``ship_drafter.curve_summary``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_wrappers import load_script

from hf_dspark.evaluation.recorder import RoundTrace


def write_jsonl(path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_unseen_prompts_are_the_unanswered_tails_of_their_pools(tmp_path, monkeypatch):
    data, gsm8k = tmp_path / "data", tmp_path / "gsm8k.jsonl"
    monkeypatch.setenv("HF_DSPARK_EVAL_DIR", str(tmp_path / "eval"))
    write_jsonl(tmp_path / "eval" / "gsm8k.jsonl", [{"turns": ["What is the capital of the moon base alpha?"]}])
    write_jsonl(gsm8k, [{"turns": [f"Tom has {i} apples and buys {i + 1} more. How many apples does he have?"]}
                        for i in range(6)])
    templated = [f"Write a short poem about the colour number {i}." for i in range(5)]
    write_jsonl(data / "smollm2" / "prompts_template.jsonl", [{"turns": [t]} for t in templated])
    write_jsonl(data / "heldout" / "chat.jsonl", [{"turns": [templated[4]]}])  # the held-out set stays untouched
    answered = [templated[3]]  # the training set answered this one: it is seen
    write_jsonl(data / "smollm2" / "train.jsonl", [{"messages": [{"role": "user", "content": t},
                                                                 {"role": "assistant", "content": "..."}]}
                                                   for t in answered])
    out = tmp_path / "prompts.jsonl"
    load_script("unseen_prompts").main(["--data", str(data), "--gsm8k", str(gsm8k), "--pools", "gsm8k", "templated",
                                        "--per-source", "2", "--out", str(out)])
    chosen = [json.loads(line)["turns"][0] for line in out.read_text().splitlines()]
    assert len(chosen) == 4
    assert [c.split(" ")[2] for c in chosen[:2]] == ["4", "5"]  # the GSM8K pool's tail, evaluation suffix added
    assert chosen[2:] == templated[1:3]  # the tail left after dropping the answered and the held-out prompt


def test_check_fails_once_training_has_answered_a_calibration_prompt(tmp_path, caplog):
    data, prompts = tmp_path / "data", tmp_path / "prompts.jsonl"
    turns = ["Name three birds that cannot fly.", "Why is the sky blue at noon but red at dusk?"]
    write_jsonl(prompts, [{"turns": [t], "category": "magpie"} for t in turns])
    write_jsonl(data / "smollm2" / "train.jsonl", [{"messages": [{"role": "user", "content": "Something else."},
                                                                 {"role": "assistant", "content": "..."}]}])
    script = load_script("unseen_prompts")
    with pytest.raises(SystemExit) as clean:
        script.main(["--data", str(data), "--check", str(prompts)])
    assert clean.value.code == 0
    # a later regeneration answers one of them: the file no longer calibrates honestly
    write_jsonl(data / "smollm2-more" / "train.jsonl", [{"messages": [{"role": "user", "content": turns[1]},
                                                                      {"role": "assistant", "content": "..."}]}])
    with pytest.raises(SystemExit) as stale:
        script.main(["--data", str(data), "--check", str(prompts)])
    assert stale.value.code == 1
    assert "1 of 2 prompts" in caplog.text and "sky blue" in caplog.text


def test_calibration_code_prompts_come_from_modules_nothing_else_uses():
    from hf_dspark.training.prompt_sources import (CALIBRATION_CODE_MODULES, HELD_OUT_CODE_MODULES,
                                                   TRAIN_CODE_MODULES, code_prompts)

    assert not set(CALIBRATION_CODE_MODULES) & (set(TRAIN_CODE_MODULES) | set(HELD_OUT_CODE_MODULES))
    calibration = {q.first_turn for q in code_prompts(CALIBRATION_CODE_MODULES)}
    assert len(calibration) >= 260  # enough for --per-source 130 on any supported Python
    assert not calibration & {q.first_turn for q in code_prompts(TRAIN_CODE_MODULES, seed=33000)}


def test_score_calibration_scores_the_stored_fit_on_other_rounds(tmp_path, capsys):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(400, 3))
    accepted = (rng.random(400) < 0.4).astype(int)  # position 1 accepted 40 % of the time
    rounds = RoundTrace.from_rounds([3] * 400, accepted, confidence_logits=logits).save(tmp_path / "rounds.npz")
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({
        "confidence_temperatures": [1.0, 1.0, 1.0], "confidence_offsets": [0.0, 0.0, 0.0],
        "greedy_confidence_temperatures": [1.0, 1.0, 1.0], "greedy_confidence_offsets": [5.0, 0.0, 0.0]}))
    script = load_script("score_calibration")
    script.main(["--drafter", str(drafter), "--rounds", str(rounds), "--greedy"])
    greedy = capsys.readouterr().out.splitlines()
    script.main(["--drafter", str(drafter), "--rounds", str(rounds)])
    sampling = capsys.readouterr().out.splitlines()
    row = lambda lines: [c.strip() for c in lines[2].split("|")[1:-1]]  # position 1
    assert row(greedy)[:4] == row(sampling)[:4] == ["rounds.npz", "1", "400", f"{accepted.mean():.3f}"]
    assert float(row(greedy)[4]) > 0.9 > 0.6 > float(row(sampling)[4])  # the greedy fit's offset of +5 is read


def test_curve_summary_reads_the_best_row_for_the_card(tmp_path):
    curve = tmp_path / "smollm2" / "curve.jsonl"
    rows = [{"step": 200, "train_tokens": 1000, "train_loss": 2.0,
             "heldout": {"chat": {"tau_greedy": 1.30, "acceptance": [0.2, 0.1]},
                         "code": {"tau_greedy": 1.40, "acceptance": [0.3, 0.2]}}},
            {"step": 400, "train_tokens": 2500, "train_loss": 1.9, "cool_down_steps": 150,
             "heldout": {"chat": {"tau_greedy": 1.35, "acceptance": [0.25, 0.125]},
                         "code": {"tau_greedy": 1.50, "acceptance": [0.35, 0.3]}}},
            {"step": 600, "train_tokens": 4000, "train_loss": 1.8,
             "heldout": {"chat": {"tau_greedy": 1.33, "acceptance": [0.2, 0.1]},
                         "code": {"tau_greedy": 1.45, "acceptance": [0.3, 0.2]}}}]
    write_jsonl(curve, rows)
    training, evaluation = load_script("ship_drafter").curve_summary(curve, "the target's answers")
    assert training["training tokens"].startswith("2,500") and training["final loss"] == 1.9
    assert training["cool-down"].startswith("150 steps") and training["data"] == "the target's answers"
    chat = evaluation["held-out chat (smollm2 curve)"]
    assert chat["tau"] == 1.35 and list(chat.values())[1] == "0.25 / 0.12"
    with pytest.raises(SystemExit, match="no rows"):
        load_script("ship_drafter").curve_summary(tmp_path / "missing.jsonl", None)
