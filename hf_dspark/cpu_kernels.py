"""Faster CPU inference kernels: skinny ``W @ xᵀ`` linears and GQA-folded verify attention (together
:class:`loop_kernels`, what hf-dspark's loop runs a CPU fp32 target with) and oneDNN prepacking (opt-in).

Why: on CPUs without bf16 matmul units, stock fp32 ``F.linear`` has slow 1-row and small-M paths, so a plain
decoding step is slower than the memory bandwidth allows and verifying k tokens costs much more than one.

* :class:`skinny_linears` (on by default inside hf-dspark's decoding loop on a CPU fp32 target; also a public
  context manager for plain ``generate``) computes 1-16 rows as ``W @ xᵀ`` with 2 to 16 columns: no copy of any
  weight, results within the last bits of ``F.linear``'s; one step and short verifies cost well under the stock
  kernels' (docs/cpu_kernels.md and BENCHMARKS.md have the measurements).
* :class:`folded_gqa_attention` (with the skinny linears in hf-dspark's loop) attends a verify step's several
  query tokens over grouped key/value heads without transformers' ``repeat_kv`` copies.
* :func:`prepack_linears` (opt-in, replaces the modules) packs each weight once for oneDNN (cheaper wide verifies
  and plain steps), at the cost of a packed copy of every weight.

Both differ from ``F.linear`` in the last bits (~1e-5 to 1e-4 on logits), as stock 1-row and k-row products
already differ from each other. Inference only: with gradients, or off CPU, or in another dtype, they fall back
to ``F.linear`` on the original weight (tied embeddings keep working).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class PrepackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared, so tied weights and state_dict stay as they were
        self.bias = linear.bias
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked=oneDNN"


def cpu_has_bf16_units(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 natively (x86 AVX512-BF16 / AMX-BF16, Arm BF16): only there does a bf16
    matmul run faster than fp32; elsewhere oneDNN emulates it and bf16 autocast makes training slower.

    ``cpuinfo``: the text of /proc/cpuinfo (read when None; an unreadable one, as off Linux, means no)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def prepacking_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def prepack_linears(model: nn.Module) -> nn.Module:
    """Replace every fp32 CPU ``nn.Linear`` in ``model`` (in place) by a :class:`PrepackedLinear`."""
    if not prepacking_available():
        logger.warning("oneDNN prepacking is not available in this torch build; model left unchanged")
        return model
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
                setattr(parent, name, PrepackedLinear(child))
                replaced += 1
    logger.info("Prepacked %d linear layers for oneDNN", replaced)
    return model


# ---------------------------------------------------------------------------------------------------------
# Skinny linears: a few rows through a big fp32 weight, as ``weight @ xᵀ``
# ---------------------------------------------------------------------------------------------------------
#: rows -> rows actually multiplied (padded with copies of the first rows): the column counts MKL's ``W @ Xᵀ``
#: path handles fastest on the project's CPU (SmolLM2-135M forward, × the stock 1-token step: 1 row 0.63,
#: 5 rows as 6: 1.13 (as 8: 1.34), 9-16 rows as 16: 1.54-1.69 (stock 1.70-1.81; as 12: 1.74-1.84))
SKINNY_PADDED_ROWS = (0, 2, 2, 4, 4, 6, 6, 8, 8) + (16,) * 8
#: more rows than this go through ``F.linear`` unchanged
SKINNY_MAX_ROWS = len(SKINNY_PADDED_ROWS) - 1
#: the kernel's name in step-cost cache keys: a table measured with one kernel is not valid for the other
SKINNY_KERNEL = "skinny-v2"
STOCK_KERNEL = "stock"


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for inference on CPU fp32, fast when ``x`` has 1-16 rows.

    Why: stock fp32 ``F.linear`` computes ``x @ Wᵀ``; with one row MKL runs a gemv that uses one core's memory
    bandwidth, with 2-16 rows a small-M gemm that is slower still. ``W @ xᵀ`` with 2 to 16 columns
    (:data:`SKINNY_PADDED_ROWS`) streams the weight once on all cores, for one row as for sixteen. The same products are summed in another order, so results differ from
    ``F.linear`` in the last bits (as the stock kernels' own 1-row and k-row results differ from each other).
    Anything else — grad, other devices or dtypes, more rows — is plain ``F.linear``."""
    # every check is an attribute read: this runs for each of a model's linears in every forward
    shape = x.shape
    if (not shape or x.dtype is not torch.float32 or weight.dtype is not torch.float32 or not x.is_cpu
            or not weight.is_cpu or weight.dim() != 2
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    width = shape[-1]
    rows = x.numel() // width if width else 0
    if not 1 <= rows <= SKINNY_MAX_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, width)
    extra = SKINNY_PADDED_ROWS[rows] - rows
    if extra:  # pad with copies of the first rows (never more than there are), sliced off the result
        flat = torch.cat((flat, flat if extra == rows else flat[:extra]))
    out = torch.mm(weight, flat.t()).t()  # [padded rows, out], transposed
    out = (out[:rows] if extra else out).contiguous()
    if bias is not None:
        out += bias
    return out.view(shape[:-1] + (weight.shape[0],))


class skinny_linears:  # noqa: N801 (a context manager used like a function, as torch.no_grad)
    """Within the block, every CPU fp32 ``nn.Linear`` of ``models`` computes with :func:`skinny_linear` — in this
    thread only.

    Used around hf-dspark's decoding loop (``generate`` with a drafter, the engine's steps) where the target and
    drafter see 1-16 rows per forward; ``hf_dspark.skinny_linears(model)`` gives plain ``generate`` the same
    kernel (``with skinny_linears(model): model.generate(...)``). The modules get a patched ``forward`` on the
    instance while any thread is inside the block, and that forward runs the skinny kernel only for threads that
    entered it: a plain ``generate`` on the same model in another thread keeps the stock kernel, and one thread
    leaving the block never switches another's kernel mid-call. Modules whose ``forward`` is already replaced on
    the instance (accelerate hooks) are left alone; re-entering is a no-op. A model's linears are found once (the
    engine enters this every step, and walking the module tree each time would cost a visible share of a step); a
    linear added to the model later keeps its stock kernel."""

    def __init__(self, *models: nn.Module | None):
        self.models = [m for m in models if m is not None]
        self._patched: list[nn.Linear] = []

    def __enter__(self):
        active = _THREAD.models
        for model in self.models:
            active[id(model)] = active.get(id(model), 0) + 1
        with _PATCH_LOCK:
            for model in self.models:
                for module, forward in _linear_forwards(model):
                    state = module.__dict__
                    if state.get("forward") is forward:
                        _PATCH_COUNTS[module] += 1
                    elif "forward" not in state:  # another device or dtype falls back to F.linear by itself
                        state["forward"] = forward
                        _PATCH_COUNTS[module] = 1
                    else:
                        continue
                    self._patched.append(module)
        return self

    def __exit__(self, *exc) -> None:
        active = _THREAD.models
        for model in self.models:
            active[id(model)] -= 1
            if not active[id(model)]:
                del active[id(model)]
        with _PATCH_LOCK:
            for module in self._patched:
                _PATCH_COUNTS[module] -= 1
                if not _PATCH_COUNTS[module]:  # the last thread inside leaves: the stock forward comes back
                    del _PATCH_COUNTS[module]
                    module.__dict__.pop("forward", None)
        self._patched.clear()


class _ThreadKernels(threading.local):
    """What the current thread runs inside: models (by id) in :class:`skinny_linears` and their entry depth, and
    the depth of :class:`folded_gqa_attention` blocks."""

    def __init__(self) -> None:
        self.models: dict[int, int] = {}
        self.folded = 0


_THREAD = _ThreadKernels()
_PATCH_LOCK = threading.Lock()
_PATCH_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> blocks holding its patch


_LINEAR_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _linear_forwards(model: nn.Module) -> list[tuple[nn.Linear, "_SkinnyForward"]]:
    """Each ``nn.Linear`` of ``model`` (once, shared ones once) with its patched forward, found on first use."""
    found = _LINEAR_FORWARDS.get(model)
    if found is None:
        modules = {id(m): m for m in model.modules() if type(m) is nn.Linear}
        found = _LINEAR_FORWARDS[model] = [(m, _SkinnyForward(m, id(model))) for m in modules.values()]
    return found


class _SkinnyForward:
    """The patched ``forward`` of one module (a class, not a closure, so :func:`linear_kernel` can recognise it):
    the skinny kernel in threads inside :class:`skinny_linears` for its model, the stock one elsewhere."""

    __slots__ = ("module", "owner")

    def __init__(self, module: nn.Linear, owner: int):
        self.module, self.owner = module, owner

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        if self.owner in _THREAD.models:
            return skinny_linear(x, module.weight, module.bias)
        return F.linear(x, module.weight, module.bias)

    def active(self) -> bool:
        """Whether the current thread computes this module with the skinny kernel."""
        return self.owner in _THREAD.models


#: output heads smaller than this are not timed (too fast to measure; tiny test models): the loop's kernels are used
MEASURED_HEAD_ELEMENTS = 1 << 22
_SKINNY_PAYS: dict[tuple, bool] = {}  # (head shape, threads) -> whether the skinny kernel beat stock on this machine


def skinny_pays(model: nn.Module, repeats: int = 5) -> bool:
    """Whether :func:`skinny_linear` beats stock ``F.linear`` on this machine for ``model``'s output head, at the
    widths a decoding loop runs (1 and 4 rows): measured once per process, head shape and thread count.

    Why: the kernel works around slow small-M fp32 paths (MKL on AMD EPYC: 0.63× stock at one row), but where the
    stock paths are fast it is the slow one (an Intel Xeon VM: 2.0× at one row, hf-dspark 0.85× plain generate;
    BENCHMARKS.md). Both kernels are timed interleaved, median of ``repeats``; skinny wins only by 5 % or more."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is None or weight.numel() < MEASURED_HEAD_ELEMENTS:
        return True
    key = (tuple(weight.shape), torch.get_num_threads())
    if key not in _SKINNY_PAYS:
        weight = weight.detach()
        times: dict[str, list[float]] = {"stock": [], "skinny": []}
        with torch.no_grad():
            # a generator of its own: the global RNG is the caller's (a seeded sampling call would draw other
            # tokens on a process's first call, which measures this)
            generator = torch.Generator().manual_seed(0)
            inputs = [torch.randn(rows, weight.shape[1], generator=generator) for rows in (1, 4)]
            for _ in range(repeats + 1):  # the first round warms both kernels up and is dropped
                for name, kernel in (("stock", F.linear), ("skinny", skinny_linear)):
                    start = time.perf_counter()
                    for x in inputs:
                        kernel(x, weight)
                    times[name].append(time.perf_counter() - start)
        stock, skinny = (sorted(times[n][1:])[repeats // 2] for n in ("stock", "skinny"))
        _SKINNY_PAYS[key] = skinny < 0.95 * stock
        logger.info("CPU kernels for a %s output head on %d threads: skinny %.2f ms, stock %.2f ms -> %s", key[0],
                    key[1], 1e3 * skinny, 1e3 * stock, "skinny" if _SKINNY_PAYS[key] else "stock")
    return _SKINNY_PAYS[key]


def loop_linears(enabled: bool | None, target: nn.Module, *models: nn.Module | None):
    """The kernels hf-dspark's decoding loop runs ``target`` (and ``models``: its drafter) with: skinny linears and
    GQA-folded attention (:class:`folded_gqa_attention`) when the target is a CPU fp32 model and ``enabled`` —
    ``None`` (the default everywhere) means where they measured faster than stock on this machine
    (:func:`skinny_pays`) — else nothing changes."""
    if skinny_applies(target) and (enabled or (enabled is None and skinny_pays(target))):
        return loop_kernels(target, *models)
    return contextlib.nullcontext()


class loop_kernels:  # noqa: N801 (a context manager used like a function, as torch.no_grad)
    """:class:`skinny_linears` for ``target`` and ``models`` plus :class:`folded_gqa_attention` for ``target``:
    what hf-dspark's loop runs a CPU fp32 target with (and what a fair plain-``generate`` baseline gets too)."""

    def __init__(self, target: nn.Module, *models: nn.Module | None):
        self._contexts = (skinny_linears(target, *models), folded_gqa_attention(target))

    def __enter__(self):
        for context in self._contexts:
            context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for context in reversed(self._contexts):
            context.__exit__(*exc)


# ---------------------------------------------------------------------------------------------------------
# GQA-folded attention: several query tokens over grouped key/value heads without repeating the keys and values
# ---------------------------------------------------------------------------------------------------------
#: the attention implementation name a target's config carries inside :class:`folded_gqa_attention`
FOLDED_GQA_ATTENTION = "hf_dspark_folded_gqa_sdpa"
#: what :func:`linear_kernel` appends to a model's kernel name inside :class:`folded_gqa_attention`
FOLDED_GQA_SUFFIX = "+gqa-fold"


def folded_gqa_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with the query heads of a key/value group folded into its query length when
    a forward has several query tokens (a verify step).

    Why: with grouped-query attention (SmolLM2: 9 query heads over 3 key/value heads) and a mask, transformers'
    SDPA path copies every key and value ``n_rep`` times (``repeat_kv``) before attending. For one query token it
    already avoids that by folding the group's heads into the query dimension (``pack_gqa``); this does the same
    for q > 1: query [B, H, q, d] -> [B, H_kv, n_rep·q, d], the mask (shared by every head) tiled n_rep times along
    the query dimension. Same scores, same softmax, no copies. Anything else (one query token, no mask or a per-head one, a position bias, dropout, no
    grouping) goes to transformers' own SDPA function unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1) if _THREAD.folded else 1  # other threads: stock SDPA
    batch, heads, length, dim = query.shape
    if (groups <= 1 or length <= 1 or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.shape[1] != 1 or attention_mask.shape[2] != length or dropout
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or key.shape[1] * groups != heads):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    folded = query.reshape(batch, heads // groups, groups * length, dim)
    mask = attention_mask.repeat(1, 1, groups, 1)  # folded row g·q + i is query i of head group member g
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(out.shape[0], heads, length, dim).transpose(1, 2).contiguous(), None


def _register_folded_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FOLDED_GQA_ATTENTION, folded_gqa_sdpa)
    AttentionMaskInterface.register(FOLDED_GQA_ATTENTION, sdpa_mask)  # the masks SDPA gets, built the same way


class folded_gqa_attention:  # noqa: N801 (a context manager used like a function, as torch.no_grad)
    """Within the block, ``model`` (an SDPA target) attends with :func:`folded_gqa_sdpa` — in this thread only.

    The model's config names the folded implementation while any thread is inside the block (its attention
    function is chosen from the config), and :func:`folded_gqa_sdpa` folds only for threads inside one: a call on
    the same model from another thread attends with transformers' own SDPA, and one thread leaving never switches
    another's attention mid-call. Models with another implementation (eager, flash) are left alone; re-entering
    is a no-op."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._entered = False

    def __enter__(self):
        config = getattr(self.model, "config", None)
        with _PATCH_LOCK:
            implementation = getattr(config, "_attn_implementation", None)
            if implementation == "sdpa":
                _register_folded_attention()
                config._attn_implementation = FOLDED_GQA_ATTENTION
                _FOLDED_COUNTS[self.model] = 0
            elif implementation != FOLDED_GQA_ATTENTION or self.model not in _FOLDED_COUNTS:
                return self
            _FOLDED_COUNTS[self.model] += 1
            self._entered = True
        _THREAD.folded += 1
        return self

    def __exit__(self, *exc) -> None:
        if not self._entered:
            return
        self._entered = False
        _THREAD.folded -= 1
        with _PATCH_LOCK:
            _FOLDED_COUNTS[self.model] -= 1
            if not _FOLDED_COUNTS[self.model]:
                del _FOLDED_COUNTS[self.model]
                self.model.config._attn_implementation = "sdpa"


_FOLDED_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> blocks holding the switch


def skinny_applies(model: nn.Module) -> bool:
    """Whether :class:`skinny_linears` changes anything for ``model`` (a CPU fp32 output head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32


def linear_kernel(model: nn.Module) -> str:
    """The kernels ``model`` runs with right now: :data:`SKINNY_KERNEL` inside :class:`skinny_linears`, with
    :data:`FOLDED_GQA_SUFFIX` inside :class:`folded_gqa_attention` too (step-cost caches are keyed by it)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    forward = head.__dict__.get("forward") if head is not None else None
    patched = isinstance(forward, _SkinnyForward) and forward.active()
    kernel = SKINNY_KERNEL if patched and skinny_applies(model) else STOCK_KERNEL
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == FOLDED_GQA_ATTENTION and _THREAD.folded:
        kernel += FOLDED_GQA_SUFFIX
    return kernel
