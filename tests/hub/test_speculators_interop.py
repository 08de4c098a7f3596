"""Our speculators export, loaded and run by the speculators package itself (opt-in: ``pytest -m interop``).

``scripts/check_speculators_interop.py`` installs speculators from PyPI into an isolated directory (``--no-deps``;
``HF_DSPARK_INTEROP_SITE`` overrides where) and, in its own process, loads every kind of export with
``SpeculatorModel.from_pretrained``: no missing / unexpected keys, every tensor equal, and its forward logits and
confidences equal to ours on the same features. When speculators cannot be installed (no network, no wheel), the
test is skipped, not failed. Default test runs never select it (see ``conftest.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_speculators_interop.py"
SKIP = 3


def run_interop_check(tmp_path, *args: str) -> tuple[dict, int]:
    """The check script in its own process (speculators goes on that process's path only): its JSON summary and exit
    status; skips when speculators cannot be installed here."""
    out = tmp_path / "interop.json"
    cmd = [sys.executable, str(SCRIPT), *args, "--json", str(out)]
    if os.environ.get("HF_DSPARK_INTEROP_SITE"):
        cmd += ["--site", os.environ["HF_DSPARK_INTEROP_SITE"]]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode == SKIP:
        pytest.skip(f"speculators could not be installed: {proc.stderr.strip()[-500:]}")
    assert out.is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.returncode


@pytest.mark.interop
def test_speculators_loads_and_runs_our_exports(tmp_path):
    summary, returncode = run_interop_check(tmp_path)
    results = {r["case"]: r for r in summary["results"]}
    failed = {name: r["problems"] for name, r in results.items() if not r["ok"]}
    assert not failed, failed
    assert returncode == 0
    # every kind of export we write: full and reduced vocabulary, the three heads, self-contained, DFlash
    assert set(results) == {"dspark-markov-full", "dspark-markov-reduced-vocab", "dspark-gated", "dspark-rnn",
                            "dspark-markov-self-contained", "dflash-upstream-convention"}
    for name, result in results.items():
        assert result["loading_info"]["missing_keys"] == [] and result["loading_info"]["unexpected_keys"] == [], name
        assert result["forward"]["logits_max_abs_diff"] <= 1e-5, name
    assert results["dspark-markov-reduced-vocab"]["speculators_class"] == "DSparkDraftModel"
    assert results["dflash-upstream-convention"]["speculators_class"] == "DFlashDraftModel"


@pytest.mark.interop
def test_speculators_loads_and_runs_the_shipped_drafter(tmp_path):
    """The embedded default drafter leaves for vLLM intact: speculators loads its export with no missing or unexpected
    keys, equal tensors, and logits / confidences equal to ours up to fp32 rounding (relative to their size: a
    trained drafter's logits reach tens)."""
    from hf_dspark.embedded import locate_gguf

    try:
        locate_gguf()
    except (FileNotFoundError, ImportError) as err:
        pytest.skip(f"no embedded target: {err}")
    summary, returncode = run_interop_check(tmp_path, "--shipped")
    (result,) = summary["results"]
    assert result["ok"], result["problems"]
    assert returncode == 0
    assert result["speculators_class"] == "DSparkDraftModel" and result["tensors_checked"] > 0
    assert result["loading_info"]["missing_keys"] == [] and result["loading_info"]["unexpected_keys"] == []
    forward = result["forward"]
    assert forward["logits_max_abs_diff"] <= 1e-5 * forward["logits_max_abs"]
    assert forward["confidence_max_abs_diff"] <= 1e-5 * max(1.0, forward["confidence_max_abs"])
