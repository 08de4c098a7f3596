"""From a wheel installed outside the repository, every ``hf-dspark`` command works: nothing is read from a
checkout (no scripts/, no model_cards/). Builds the wheel from a copy of this checkout, installs it into a
throwaway venv that borrows the test environment's packages (torch, transformers: nothing is downloaded), and runs
the commands with the working directory outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["generate", "regenerate", "cache", "train", "calibrate", "eval", "bench", "serve-bench", "convert", "push"]
NOT_SHIPPED = {".git", ".venv", "build", "dist", "runs", "outputs", "data", "cache", ".pytest_cache", "__pycache__"}
HELP_ALL = """
import contextlib, io, sys
import hf_dspark
from hf_dspark.cli import main
from hf_dspark.hub.model_card import DEFAULT_TEMPLATE
print(hf_dspark.__file__, DEFAULT_TEMPLATE.is_file())
for command in sys.argv[1:]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([command, "--help"])
        except SystemExit as exit_:
            assert exit_.code in (0, None), (command, exit_.code)
    assert out.getvalue().startswith("usage: hf-dspark " + command), (command, out.getvalue()[:200])
print("helped", len(sys.argv) - 1)
"""


def copy_checkout(dst: Path) -> Path:
    """The files a build sees (tracked and untracked-but-not-ignored), so building never writes into the checkout."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.decode().split("\0")):
            if (ROOT / name).is_file():
                (dst / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, dst / name)
    else:  # not a git checkout (an sdist): everything but build outputs and local data
        shutil.copytree(ROOT, dst, dirs_exist_ok=True,
                        ignore=lambda d, names: [n for n in names if n in NOT_SHIPPED or n.endswith(".egg-info")])
    return dst


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin directory, environment, working directory outside the repository)."""
    pytest.importorskip("setuptools", reason="building the wheel offline (--no-build-isolation) needs setuptools")
    work = tmp_path_factory.mktemp("wheel")
    src = copy_checkout(work / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(work / "dist"), str(src)], check=True, cwd=work)
    wheel = next((work / "dist").glob("hf_dspark-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(work / "venv")], check=True)
    venv_python = work / "venv" / "bin" / "python"
    site = subprocess.run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # the test environment's packages, after the venv's own: torch etc. without a download; NOTE: a plain path
    # line, so the .pth files there (e.g. an editable hf_dspark) are not run and cannot shadow the wheel
    (Path(site) / "_test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv_python), "install", "--no-deps", "--no-index",
                    "--ignore-installed", "-q", str(wheel)], check=True, cwd=work)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_DSPARK_EVAL_DIR", "VIRTUAL_ENV")}
    # the CLI's caches (a tiny target's step-cost profile) in the throwaway folder, not in the user's ~/.cache
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", HF_DSPARK_CACHE=str(work / "cache"))
    outside = work / "elsewhere"
    outside.mkdir()
    return venv_python.parent, env, outside


def run(installed, *argv: str) -> subprocess.CompletedProcess:
    bin_dir, env, cwd = installed
    return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_every_command_has_help_from_the_wheel_not_the_checkout(installed):
    done = run(installed, "hf-dspark", "--help")
    assert done.returncode == 0 and all(command in done.stdout for command in COMMANDS), done.stderr
    done = run(installed, "python", "-c", HELP_ALL, *COMMANDS)
    assert done.returncode == 0 and f"helped {len(COMMANDS)}" in done.stdout, done.stdout + done.stderr
    where, template_shipped = done.stdout.splitlines()[0].split()
    assert Path(where).is_relative_to(installed[0].parent) and template_shipped == "True", done.stdout


@pytest.mark.slow
def test_generate_and_push_run_from_the_wheel(installed, tiny_target_dir, tmp_path):
    path, prompt, expected = tiny_target_dir
    done = run(installed, "hf-dspark", "generate", "--target", str(path), "--drafter", str(path / "drafter"),
               "--prompt", prompt, "--max-new-tokens", "12")
    assert done.returncode == 0 and done.stdout.strip() == expected.strip(), done.stdout + done.stderr
    done = run(installed, "hf-dspark", "push", str(path / "drafter"), "org/tiny", "--dry-run", str(tmp_path / "up"))
    assert done.returncode == 0, done.stderr
    assert "library_name: hf-dspark" in (tmp_path / "up" / "README.md").read_text()  # the packaged template


@pytest.mark.slow
def test_bench_outside_the_repository_says_where_the_prompts_go(installed):
    done = run(installed, "hf-dspark", "bench", "--per-benchmark", "1", "--max-new-tokens", "8", "--temperatures", "0")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "HF_DSPARK_EVAL_DIR" in done.stderr.strip().splitlines()[-1]
