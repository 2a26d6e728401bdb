"""FP8 Linear with DeepSeek-V3's fine-grained scaling, its config and recipes, and the model swap.

Layers, top to bottom: :class:`Fp8LinearConfig` (frozen, named recipes), ``_Fp8LinearFunction``
(the three GEMMs as an autograd Function), :class:`Fp8Linear` (an ``nn.Linear`` that runs it) and
:func:`convert_to_fp8_training` (swaps the Linears of a model in place). The GEMMs and quantizers
are called through :mod:`ptxtrain.gemm` and :mod:`ptxtrain.quant` at call time, so the fast
kernels that later sit behind those names are picked up without a change here.

Source: DeepSeek-V3 report §3.3; docs/design.md §1; API after torchao's
``convert_to_float8_training``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ptxtrain import _backend, gemm, quant
from ptxtrain._checks import HP_DTYPES, check_tensor

RECIPES: tuple[str, ...] = ("deepseek", "deepseek_pow2", "deepseek_wgrad_bf16", "bf16")

# The GEMM contracts (docs/design.md §2) fix the scale granularity at 128.
_GEMM_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class Fp8LinearConfig:
    """How an :class:`Fp8Linear` runs its three GEMMs (DeepSeek-V3 report §3.3; docs/design.md §1).

    The defaults are DeepSeek's recipe: all three GEMMs in FP8 E4M3, activations and output
    gradients scaled per 1x128 tile, weights per 128x128 block, fp32 scales computed online.
    Prefer :meth:`from_recipe_name`; a hand-built config is named ``"custom"`` unless told.

    Raises:
        TypeError: a flag is not a bool, a block not an int, ``fp8_dtype`` not a torch.dtype or
            ``recipe_name`` not a str.
        ValueError: a block is not 128, or ``fp8_dtype`` is not ``torch.float8_e4m3fn``.
    """

    # Fprop y = x·Wᵀ in FP8 (1D2D GEMM); False: matmul in the activation dtype.
    fprop: bool = True
    # Dgrad dx = dy·W in FP8 (1D2D GEMM on W's blocks transposed); False: high precision.
    dgrad: bool = True
    # Wgrad dW = dyᵀ·x in FP8 (1D1D GEMM over tokens); False: high precision (x is then saved
    # in its own dtype for backward instead of as FP8).
    wgrad: bool = True
    # Tile width of activations / output gradients (1 x act_block along the GEMM's K); only 128.
    act_block: int = 128
    # Edge of the weight's square scaling blocks (weight_block x weight_block); only 128.
    weight_block: int = 128
    # Round every scale up to a power of two (exact rescaling; TransformerEngine's default).
    pow2_scale: bool = False
    # Element format of every FP8 tensor, forward and backward; DeepSeek-V3 uses E4M3 only.
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    # Name shown by Fp8Linear's repr: one of RECIPES, or "custom" for a hand-built config.
    recipe_name: str = "custom"
    # Keep the weight's 128x128 quantization between calls and reuse it until the weight changes
    # (its storage or in-place version counter): micro-batches of one step quantize W once.
    # torch's fused optimizers do not bump the version: see register_fp8_cache_hooks.
    # Costs one FP8 byte per weight element (+ scales) held between steps, two with dgrad on
    # (Wᵀ's quantization is cached beside W's, so backward does no transpose).
    cache_weight_fp8: bool = True
    # The MoE experts keep their SwiGLU input [w1 x | w3 x] for backward as its 1x128 FP8
    # quantization instead of in the activation dtype (DeepSeek-V3 report §3.3, low-precision
    # storage): about half of those bytes, the largest activation of an MoE layer. Where the
    # gate/up projections run as one stacked GEMM (I a multiple of 128) and a GEMM is FP8.
    save_swiglu_input_fp8: bool = True

    def __post_init__(self) -> None:
        flags = ("fprop", "dgrad", "wgrad", "pow2_scale", "cache_weight_fp8")
        for name in (*flags, "save_swiglu_input_fp8"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        for name in ("act_block", "weight_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value != _GEMM_BLOCK:
                raise ValueError(
                    f"{name} must be {_GEMM_BLOCK} (the FP8 GEMMs of ptxtrain.gemm take "
                    f"128-wide scale blocks), got {value}"
                )
        if not isinstance(self.fp8_dtype, torch.dtype):
            raise TypeError(f"fp8_dtype must be a torch.dtype, got {type(self.fp8_dtype).__name__}")
        if self.fp8_dtype != quant.FP8_DTYPE:
            raise ValueError(
                f"fp8_dtype must be torch.float8_e4m3fn (DeepSeek-V3 uses E4M3 for every FP8 "
                f"tensor, forward and backward), got {self.fp8_dtype}"
            )
        if not isinstance(self.recipe_name, str):
            raise TypeError(f"recipe_name must be a str, got {type(self.recipe_name).__name__}")

    @classmethod
    def from_recipe_name(cls, name: str) -> Fp8LinearConfig:
        """The config of a named recipe.

        - ``"deepseek"``: all three GEMMs in FP8, 1x128 / 128x128 tiles, fp32 scales (report §3.3).
        - ``"deepseek_pow2"``: the same with scales rounded up to powers of two.
        - ``"deepseek_wgrad_bf16"``: fprop and dgrad in FP8, wgrad in the activation dtype.
        - ``"bf16"``: every GEMM in high precision; an Fp8Linear then equals ``nn.Linear``
          exactly, and :func:`convert_to_fp8_training` leaves a model unchanged.

        Raises:
            TypeError: ``name`` is not a str.
            ValueError: ``name`` is not one of :data:`RECIPES` (the message lists them).
        """
        if not isinstance(name, str):
            raise TypeError(f"recipe name must be a str, got {type(name).__name__}")
        if name == "deepseek":
            return cls(recipe_name=name)
        if name == "deepseek_pow2":
            return cls(pow2_scale=True, recipe_name=name)
        if name == "deepseek_wgrad_bf16":
            return cls(wgrad=False, recipe_name=name)
        if name == "bf16":
            return cls(
                fprop=False, dgrad=False, wgrad=False, save_swiglu_input_fp8=False,
                recipe_name=name,
            )  # fmt: skip
        raise ValueError(f"recipe name must be one of {', '.join(RECIPES)}; got {name!r}")

    @property
    def fp8_gemms(self) -> tuple[str, ...]:
        """Names of the GEMMs that run in FP8, e.g. ``("fprop", "dgrad")``."""
        return tuple(g for g in ("fprop", "dgrad", "wgrad") if getattr(self, g))

    @property
    def any_fp8(self) -> bool:
        """Whether at least one GEMM runs in FP8 (False for the ``"bf16"`` recipe)."""
        return bool(self.fp8_gemms)


# Bumped by :func:`invalidate_fp8_weight_caches`: part of every cached weight quantization's key,
# for weight changes the version counter does not show (e.g. a replayed CUDA graph).
_cache_generation = 0


def invalidate_fp8_weight_caches() -> None:
    """Mark every cached FP8 weight quantization stale.

    For code that changes weights without bumping their version counter and outside an
    optimizer :func:`register_fp8_cache_hooks` covers: a replayed CUDA graph that holds the
    optimizer update (the Python side of ``step()`` does not run on replay), or an in-place
    write through ``weight.data``. The next forward of each :class:`Fp8Linear` (and FP8
    ``Experts``) quantizes its weight again.
    """
    global _cache_generation
    _cache_generation += 1


def register_fp8_cache_hooks(optimizer: torch.optim.Optimizer):
    """Make ``optimizer``'s steps drop the cached FP8 weight quantizations of its parameters.

    Needed only for optimizers that write parameters without bumping their version counter:
    torch's fused ones (``torch.optim.AdamW(fused=True)``, ``Adam(fused=True)``,
    ``SGD(fused=True)``), or any custom kernel writing through ``data_ptr()``. torch's
    for-loop and foreach paths (the defaults) bump it, and :class:`ptxtrain.optim.AdamW` does so
    itself. Registers a step post-hook on this optimizer only (``register_step_post_hook``)
    that bumps the version of every parameter in its param groups.

    Returns:
        The hook's handle (``.remove()`` takes it off).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )

    def bump_versions(opt, args, kwargs) -> None:
        params = [p for group in opt.param_groups for p in group["params"]]
        torch.autograd.graph.increment_version(params)

    return optimizer.register_step_post_hook(bump_versions)


def weight_cache_key(w: torch.Tensor, cfg: Fp8LinearConfig) -> tuple | None:
    """The key under which a weight's cached FP8 quantization stays valid, or None when it must
    not be cached (``cfg.cache_weight_fp8`` off, no FP8 GEMM reads W, or an inference tensor,
    which keeps no version counter). Used by :class:`Fp8Linear` and ``moe.Experts``.

    The key is the weight's storage address, in-place version counter, the count of
    :func:`invalidate_fp8_weight_caches` calls, shape, dtype, device and the config's scale rule
    and dgrad flag (the cached entry holds Wᵀ's quantization only with dgrad). An optimizer's
    in-place update (torch's for-loop and foreach paths, :class:`ptxtrain.optim.AdamW` on every
    path) and ``load_state_dict``'s copy bump the version; torch's fused optimizers do not
    unless :func:`register_fp8_cache_hooks` was called on them. Assigning new data
    (``weight.data = ...``) changes the address, which cannot be the old one while the cache
    holds an alias of the old storage. (In-place writes through ``weight.data`` are not seen:
    call :func:`invalidate_fp8_weight_caches` after them.)
    """
    if not cfg.cache_weight_fp8 or not (cfg.fprop or cfg.dgrad):
        return None
    try:
        version = w._version
    except RuntimeError:
        return None
    return (
        w.data_ptr(), version, _cache_generation, tuple(w.shape), w.dtype, w.device,
        cfg.pow2_scale, cfg.dgrad,
    )  # fmt: skip


def resolve_config(config: Fp8LinearConfig | str | None) -> Fp8LinearConfig:
    """The :class:`Fp8LinearConfig` that ``config`` names: itself, the recipe of that name
    (:data:`RECIPES`), or the ``"deepseek"`` recipe for None.

    Raises:
        TypeError: ``config`` is neither an Fp8LinearConfig, a str nor None.
        ValueError: an unknown recipe name (:meth:`Fp8LinearConfig.from_recipe_name`).
    """
    if config is None:
        return Fp8LinearConfig.from_recipe_name("deepseek")
    if isinstance(config, str):
        return Fp8LinearConfig.from_recipe_name(config)
    if not isinstance(config, Fp8LinearConfig):
        raise TypeError(
            f"config must be an Fp8LinearConfig, a recipe name or None, got {type(config).__name__}"
        )
    return config


def _sf_layout(device: torch.device) -> str:
    """Scale layout to ask of the 1x128 quantizers: MN-major on CUDA, where the PTX and cuBLAS
    GEMMs read it without a transpose copy per call; row-major (the reference's) elsewhere."""
    return "mn_major" if device.type == "cuda" else "row"


def quantize_activation(
    x: torch.Tensor, pow2: bool, row: bool, col: bool, sf_layout: str = "row"
) -> tuple[torch.Tensor | None, ...]:
    """``x`` [M, K]'s 1x128 tiles (``row``: the A operand of Fprop / Dgrad) and 128x1 tiles
    stored transposed (``col``: an operand of the 1D1D Wgrad), one pass when both:
    ``(x_fp8 [M, K], sf, xt_fp8 [K, M], sf_t)``, None where not asked for. Scales in
    ``sf_layout``; raises as the :mod:`ptxtrain.quant` functions."""
    kw = dict(pow2_scale=pow2, sf_layout=sf_layout)
    if row and col:
        return quant.per_token_cast_to_fp8_both(x, **kw)
    if row:
        return (*quant.per_token_cast_to_fp8(x, **kw), None, None)
    if col:
        return (None, None, *quant.per_token_cast_to_fp8_t(x, **kw))
    return None, None, None, None


def complete_quantization(parts: tuple | None, row: bool, col: bool, quantize) -> tuple:
    """``parts`` (an input's shared quantization, or None) with the parts a call needs and it
    lacks made by ``quantize(row, col)`` (:func:`quantize_activation`'s result)."""
    fp8, sf, t_fp8, t_sf = parts or (None,) * 4
    want_row, want_t = row and fp8 is None, col and t_fp8 is None
    if want_row or want_t:
        q = quantize(want_row, want_t)
        if want_row:
            fp8, sf = q[0], q[1]
        if want_t:
            t_fp8, t_sf = q[2], q[3]
    return fp8, sf, t_fp8, t_sf


def gemm_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """Output dtype to ask of an FP8 GEMM whose result ends up in ``dtype``: bfloat16 for
    bfloat16, else float32 (the GEMMs write only those two; a float16 or float64 result is cast
    from float32)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _gemm_1d2d(a: tuple, b: tuple, out_dtype: torch.dtype) -> torch.Tensor:
    """``gemm.fp8_gemm_nt`` minus its argument checks: the operands come straight from the
    quantizers (shapes, dtypes, scale layouts and devices right by construction), so the
    selected backend's ``fp8_gemm_nt_unchecked`` runs directly — the dispatcher's own path after
    its validation, same backend choice, same result."""
    m, k = a[0].shape
    n = b[0].shape[0]
    mod = _backend.load(gemm.__name__, gemm.select_backend("1d2d", m, n, k, a[0].device))
    return mod.fp8_gemm_nt_unchecked(a, b, None, out_dtype)


def _gemm_1d1d(
    a: tuple, b: tuple, out_dtype: torch.dtype, out: torch.Tensor | None = None, acc=False
) -> torch.Tensor:
    """``gemm.fp8_gemm_nt_1d1d`` minus its argument checks (see :func:`_gemm_1d2d`); ``out`` /
    ``acc``: write (add) into an FP32 ``out``."""
    m, k = a[0].shape
    n = b[0].shape[0]
    mod = _backend.load(gemm.__name__, gemm.select_backend("1d1d", m, n, k, a[0].device))
    return mod.fp8_gemm_nt_1d1d_unchecked(a, b, out, acc, out_dtype)


def main_grad_target(weight: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """Where an FP8 wgrad GEMM may write ``weight``'s gradient straight into the optimizer's
    FP32 buffer (Megatron's gradient-accumulation fusion): ``(weight.main_grad, accumulate)``,
    or None (use autograd's ``.grad``).

    ``ptxtrain.optim.AdamW`` on its fused path keeps ``weight.main_grad`` (FP32, the weight's
    shape) and says whether it already holds this step's partial sum (``accumulate``: ``D +=``)
    or stale values (``D =``). Writing there saves the weight-dtype gradient, its cast and the
    optimizer hook's read-add-write of the FP32 buffer: ~12 bytes per parameter per
    micro-batch. The caller then calls :func:`ptxtrain.optim.mark_grad_ready` and returns no
    gradient to autograd.
    """
    buf = getattr(weight, "main_grad", None)
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.float32:
        return None
    if buf.shape != weight.shape or not buf.is_contiguous():
        return None
    from ptxtrain.optim import grad_ready

    try:
        return buf, grad_ready(weight)
    except ValueError:  # a main_grad that no fused AdamW owns: leave it alone
        return None


def autocast_off(device_type: str):
    """Disable autocast around the reference GEMMs (their fp32 matmuls must stay fp32)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def save_operands(ctx, *, weight_t, weight_hp, input_t, input_hp) -> None:
    """Saves for backward the FP8 operands where the Dgrad / Wgrad GEMMs are FP8 (``weight_t``,
    ``input_t``: ``(fp8, sf)`` pairs) and the high-precision tensor only where one is needed
    without them; :func:`saved_operands` gives them back by name (shared with
    :mod:`ptxtrain.nn.fp8_grouped`)."""
    saved: dict[str, torch.Tensor] = {}
    if weight_t is not None:
        saved.update(weight_t_fp8=weight_t[0], weight_t_sf=weight_t[1])
    elif weight_hp is not None:
        saved["weight_hp"] = weight_hp
    if input_t is not None:
        saved.update(input_t_fp8=input_t[0], input_t_sf=input_t[1])
    elif input_hp is not None:
        saved["input_hp"] = input_hp
    ctx.saved_names = tuple(saved)
    ctx.save_for_backward(*saved.values())


def saved_operands(ctx) -> dict[str, torch.Tensor]:
    """The tensors :func:`save_operands` saved, by name."""
    return dict(zip(ctx.saved_names, ctx.saved_tensors))


class _Fp8LinearFunction(torch.autograd.Function):
    """``y = x·Wᵀ + b`` with the GEMMs chosen by an :class:`Fp8LinearConfig`.

    Inputs: x [M, K] (fp32 / bf16 / fp16), weight [N, K], bias [N] or None, config, whether
    grad mode was on at the call (nothing is prepared for backward when it was off), the
    cached weight quantization and x's shared quantization (:meth:`Fp8Linear.quantize_input`,
    or None).
    Output: y [M, N] in x's dtype.
    """

    @staticmethod
    def forward(ctx, input_hp, weight_hp, bias_hp, config, grad_enabled, weight_q=None,
                input_q=None):  # fmt: skip
        # needs_input_grad ignores an outer no_grad / inference_mode: honour grad_enabled too.
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        act_dtype = input_hp.dtype
        pow2 = config.pow2_scale
        keep_xt_fp8 = need_dw and config.wgrad  # 128x1 tiles of x, stored transposed [K, M]
        layout = _sf_layout(input_hp.device)
        with autocast_off(input_hp.device.type):
            # -- quantize x: 1x128 for fprop, 128x1 (transposed) for wgrad; one pass when both.
            # ``input_q`` (the same values' quantization, shared by projections of one input)
            # supplies the parts it holds.
            input_fp8, input_sf, input_t_fp8, input_t_sf = complete_quantization(
                input_q, config.fprop, keep_xt_fp8,
                lambda row, col: quantize_activation(input_hp, pow2, row, col, layout),
            )  # fmt: skip
            # -- quantize W 128x128 once (or take the module's cached copy, ``weight_q``), with
            # Wᵀ's blocks (W's, transposed) written by the same pass when dgrad will need them.
            need_wt = need_dx and config.dgrad
            weight_fp8 = weight_sf = weight_t_fp8 = weight_t_sf = None
            if weight_q is not None:
                weight_fp8, weight_sf, weight_t_fp8, weight_t_sf = weight_q
            elif need_wt:
                weight_fp8, weight_sf, weight_t_fp8, weight_t_sf = quant.per_block_cast_to_fp8_both(
                    weight_hp, pow2_scale=pow2
                )
            elif config.fprop:
                weight_fp8, weight_sf = quant.per_block_cast_to_fp8(weight_hp, pow2_scale=pow2)
            # -- Fprop: y [M, N] = x [M, K] · Wᵀ; bias added in fp32, one rounding to act_dtype.
            if config.fprop:
                out_dtype = gemm_out_dtype(act_dtype) if bias_hp is None else torch.float32
                y = _gemm_1d2d((input_fp8, input_sf), (weight_fp8, weight_sf), out_dtype)
                if bias_hp is not None:
                    y = y + bias_hp.float()
                y = y.to(act_dtype)
            else:
                bias_act = None if bias_hp is None else bias_hp.to(act_dtype)
                y = F.linear(input_hp, weight_hp.to(act_dtype), bias_act)

        # -- Save for backward: FP8 data wherever the GEMM is FP8; high precision only where a
        # GEMM was configured off (the weight is a Parameter anyway, so saving it costs nothing).
        save_operands(
            ctx,
            weight_t=(weight_t_fp8, weight_t_sf) if need_wt else None,
            weight_hp=weight_hp if need_dx else None,
            input_t=(input_t_fp8, input_t_sf) if keep_xt_fp8 else None,
            input_hp=input_hp if need_dw else None,
        )
        ctx.config = config
        ctx.act_dtype = act_dtype
        ctx.weight_dtype = weight_hp.dtype
        ctx.weight = weight_hp if need_dw else None  # for main_grad_target in backward
        ctx.bias_dtype = None if bias_hp is None else bias_hp.dtype
        return y

    @staticmethod
    def backward(ctx, grad_output):
        config = ctx.config
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        saved = saved_operands(ctx)
        pow2 = config.pow2_scale
        dy = grad_output  # [M, N], y's dtype (= the activation dtype)
        layout = _sf_layout(dy.device)
        dx = dw = db = None
        with autocast_off(dy.device.type):
            # -- quantize dy: 1x128 along N for dgrad, 128x1 (transposed [N, M]) for wgrad.
            fp8_dgrad, fp8_wgrad = need_dx and config.dgrad, need_dw and config.wgrad
            dy_fp8, dy_sf, dy_t_fp8, dy_t_sf = quantize_activation(
                dy, pow2, fp8_dgrad, fp8_wgrad, layout
            )
            # -- Dgrad: dx [M, K] = dy [M, N] · W [N, K]; B = Wᵀ [K, N] from W's blocks transposed.
            if fp8_dgrad:
                weight_t = (saved["weight_t_fp8"], saved["weight_t_sf"])
                dx = _gemm_1d2d((dy_fp8, dy_sf), weight_t, gemm_out_dtype(ctx.act_dtype))
                dx = dx.to(ctx.act_dtype)
            elif need_dx:
                dx = dy @ saved["weight_hp"].to(dy.dtype)
            # -- Wgrad: dW [N, K] = dyᵀ [N, M] · x [M, K]; both operands 1x128 along M (1D1D).
            target = main_grad_target(ctx.weight) if fp8_wgrad else None
            if target is not None:  # straight into the optimizer's FP32 buffer (D (+)= ...)
                input_t = (saved["input_t_fp8"], saved["input_t_sf"])
                _gemm_1d1d((dy_t_fp8, dy_t_sf), input_t, torch.float32, *target)
                from ptxtrain.optim import mark_grad_ready

                mark_grad_ready(ctx.weight)  # delivered: autograd gets no weight gradient
            elif fp8_wgrad:
                input_t = (saved["input_t_fp8"], saved["input_t_sf"])
                # Written in the weight's dtype when the GEMM can (bf16 / fp32): no extra pass.
                dw_dtype = gemm_out_dtype(ctx.weight_dtype)
                dw = _gemm_1d1d((dy_t_fp8, dy_t_sf), input_t, dw_dtype)
                dw = dw.to(ctx.weight_dtype)
            elif need_dw:
                dw = (dy.t() @ saved["input_hp"].to(dy.dtype)).to(ctx.weight_dtype)
            # -- dbias [N]: summed over tokens in fp32.
            if need_db:
                db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run in FP8 with DeepSeek-V3's fine-grained scaling.

    Parameters and ``state_dict`` keys are those of ``nn.Linear`` (``weight`` [out, in],
    ``bias`` [out]), so a checkpoint loads into either class. The parameters stay in their own
    dtype (high precision); the FP8 copies live only inside a forward/backward.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        config: an :class:`Fp8LinearConfig`, a recipe name from :data:`RECIPES`, or None for
            ``"deepseek"``.

    Forward: input [*, in_features] (any leading dims, zero tokens included) of dtype float32,
    bfloat16 or float16 → output [*, out_features] in the input's dtype. Gradients: input's in the
    input's dtype, weight's and bias's in their own dtypes. Under ``torch.autocast`` the input is
    first cast to the autocast dtype (as ``nn.Linear``'s matmul would be).

    Non-finite values: a NaN or ±inf in a 1x128 tile of the input makes that tile's scale
    non-finite, so the tile dequantizes to NaN (``ptxtrain.quant.ref``); every output that reads the
    tile — the whole token row in the output, and the gradients that read it — becomes NaN. NaN/inf
    in the weight spoil the outputs reading the 128x128 block alike. They propagate, never turn
    into finite numbers. (In a GEMM configured off they follow ordinary matmul rules instead.)

    Cached weight quantization (``config.cache_weight_fp8``, on by default): W's 128x128
    quantization is kept until W's version counter changes (:func:`weight_cache_key`).
    torch's for-loop and foreach optimizers and :class:`ptxtrain.optim.AdamW` bump it at each
    step; torch's fused optimizers (``torch.optim.AdamW(fused=True)`` etc.) do not: call
    :func:`register_fp8_cache_hooks` on such an optimizer once, or the forward after a step
    reuses the old weights' quantization. After writing W through ``.data`` or replaying a CUDA
    graph that updates it, call :func:`invalidate_fp8_weight_caches`.

    Raises (from forward):
        TypeError: input is not a tensor of dtype float32 / bfloat16 / float16.
        ValueError: input is 0-D, its last dimension is not ``in_features``, or it is not on
            the weight's device.

    Source: DeepSeek-V3 report §3.3; docs/design.md §1.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        config: Fp8LinearConfig | str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = resolve_config(config)
        self._weight_fp8_key: tuple | None = None
        self._weight_fp8: tuple | None = None
        self._weight_fp8_src: torch.Tensor | None = None

    def _quantized_weight(self) -> tuple | None:
        """``(w_fp8, sf, wt_fp8, sf_t)``: W's 128x128 quantization and Wᵀ's (None, None without
        dgrad), cached while the weight is unchanged (:func:`weight_cache_key`; None: don't
        cache)."""
        cfg = self.config
        w = self.weight
        key = weight_cache_key(w, cfg)
        if key is None:
            return None
        if key != self._weight_fp8_key:
            with torch.no_grad():
                if cfg.dgrad:
                    self._weight_fp8 = quant.per_block_cast_to_fp8_both(
                        w.detach(), pow2_scale=cfg.pow2_scale
                    )
                else:
                    q, sf = quant.per_block_cast_to_fp8(w.detach(), pow2_scale=cfg.pow2_scale)
                    self._weight_fp8 = (q, sf, None, None)
            self._weight_fp8_key = key
            # An alias of the quantized storage keeps it alive while cached, so a new storage
            # swapped in through ``.data`` can never reuse its address and match the key.
            self._weight_fp8_src = w.detach()
        return self._weight_fp8

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, config: Fp8LinearConfig | str | None = None
    ) -> Fp8Linear:
        """An Fp8Linear sharing ``linear``'s Parameter objects (no copy, same device and dtype).

        An optimizer built over the old module's parameters keeps working. The new module takes
        ``linear``'s train/eval mode; hooks registered on ``linear`` are not carried over.

        Raises:
            TypeError: ``linear`` is not an ``nn.Linear``, or ``config`` is of a wrong type.
            ValueError: ``config`` is an unknown recipe name.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        config = resolve_config(config)
        with torch.device("meta"):  # allocate nothing; the real Parameters are attached below
            new = cls(linear.in_features, linear.out_features, bias=False, config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new._weight_fp8_key = new._weight_fp8 = new._weight_fp8_src = None
        new.train(linear.training)
        return new

    def _check_input(self, input: torch.Tensor) -> None:
        check_tensor("input", input, dtypes=HP_DTYPES)
        if input.dim() == 0 or input.shape[-1] != self.in_features:
            raise ValueError(
                f"input must have shape [*, {self.in_features}] (last dim = in_features), "
                f"got {tuple(input.shape)}"
            )
        if input.device != self.weight.device:
            # (Checked here: the FP8 path quantizes each on its own device and would hand a GEMM
            # kernel operands on two devices.)
            raise ValueError(
                f"input must be on the weight's device {self.weight.device}, got {input.device}"
            )

    def _fp8_input(self, input: torch.Tensor) -> torch.Tensor:
        """``input`` as the FP8 path reads it: cast as autocast would for ``nn.Linear``, then
        ``[M, K]``."""
        device_type = input.device.type
        if torch.is_autocast_enabled(device_type):
            input = input.to(torch.get_autocast_dtype(device_type))
        return input.reshape(-1, self.in_features)

    def quantize_input(self, input: torch.Tensor) -> tuple | None:
        """``input``'s quantization as this module's forward would make it, to hand to several
        FP8 projections of the same input (``forward(input, input_q=...)``; MLA's ``wq_a`` and
        ``wkv_a``, an MLP's ``w1`` and ``w3``) so they quantize it once and save one copy for
        their Wgrads.

        Returns ``(x_fp8 [M, K], sf, xt_fp8 [K, M], sf_t)`` (the 1x128 tiles when Fprop is FP8,
        the 128x1 tiles when Wgrad is and grad mode is on; None where not made), or None when
        no GEMM of the config is FP8. Raises as :meth:`forward`.
        """
        self._check_input(input)
        cfg = self.config
        if not cfg.any_fp8:
            return None
        row = cfg.fprop
        col = cfg.wgrad and torch.is_grad_enabled()  # what a forward in this mode saves
        if not (row or col):
            return None
        x = self._fp8_input(input.detach())
        with torch.no_grad(), autocast_off(x.device.type):
            return quantize_activation(x, cfg.pow2_scale, row, col, _sf_layout(x.device))

    def forward(self, input: torch.Tensor, *, input_q: tuple | None = None) -> torch.Tensor:
        """``input [*, K] -> [*, N]``; ``input_q``: :meth:`quantize_input` of this very input
        by a module of the same config (or None)."""
        self._check_input(input)
        if not self.config.any_fp8:  # "bf16" recipe: exactly nn.Linear
            return F.linear(input, self.weight, self.bias)
        lead = input.shape[:-1]
        x = self._fp8_input(input)  # [M, K]
        # (The Function turns autocast off inside, so the reference GEMMs stay in fp32.)
        grad = torch.is_grad_enabled()
        weight_q = self._quantized_weight()
        y = _Fp8LinearFunction.apply(
            x, self.weight, self.bias, self.config, grad, weight_q, input_q
        )
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        cfg = self.config
        gemms = ", ".join(cfg.fp8_gemms) or "none"
        return (
            f"{super().extra_repr()}, recipe={cfg.recipe_name}, fp8_gemms=({gemms}), "
            f"pow2_scale={cfg.pow2_scale}"
        )


def shared_input_quantization(x: torch.Tensor, *modules: nn.Module) -> dict:
    """``{"input_q": ...}`` for calling each of ``modules`` on the same ``x`` with one
    quantization of it, where every one is an :class:`Fp8Linear` of one config; else ``{}``
    (plain ``nn.Linear`` modules, mixed configs: each call quantizes on its own).

    Usage: ``q = shared_input_quantization(x, a, b); a(x, **q); b(x, **q)``. The results are
    the bits of the separate calls.
    """
    if not modules or not all(isinstance(m, Fp8Linear) for m in modules):
        return {}
    if any(m.config != modules[0].config for m in modules[1:]):
        return {}
    q = modules[0].quantize_input(x)
    return {} if q is None else {"input_q": q}


def convert_to_fp8_training(
    module: nn.Module,
    config: Fp8LinearConfig | str | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Swap every ``nn.Linear`` in ``module`` (recursively, in place) for an :class:`Fp8Linear`
    and switch every module that implements ``enable_fp8(config)`` (the MoE ``Experts``) to FP8.

    Each swapped module shares its Parameters with the original (:meth:`Fp8Linear.from_linear`),
    so parameter identity, ``state_dict`` keys and an existing optimizer are unaffected. Modules
    that are already Fp8Linear are skipped; subclasses of ``nn.Linear`` count as Linears (their own
    ``forward`` is replaced — exclude them with the filter if that matters). A Linear reachable
    under two names becomes one shared Fp8Linear.

    FP8 hook: a module that is not an ``nn.Linear`` but has a callable ``enable_fp8`` attribute
    (e.g. :class:`ptxtrain.moe.experts.Experts`, whose stacked expert weights are no Linears)
    is offered to ``module_filter_fn`` like a Linear and, if kept, gets ``enable_fp8(config)``
    called once. This lets layers above ``ptxtrain.nn`` take part without ``nn`` importing them.

    Args:
        module: the model. If it is itself an ``nn.Linear`` it cannot be swapped in place: use the
            returned module (fqn ``""`` for the filter).
        config: an :class:`Fp8LinearConfig`, a recipe name, or None for ``"deepseek"``. With a
            config that runs no GEMM in FP8 (the ``"bf16"`` recipe) nothing is swapped and
            ``module`` is returned unchanged, since such an Fp8Linear would equal ``nn.Linear``.
        module_filter_fn: ``fn(mod, fqn) -> bool`` called for each candidate (a Linear or a
            module with ``enable_fp8``) with its fully-qualified name (e.g.
            ``"model.layers.0.self_attn.q_proj"``, ``"layers.3.ffn.experts"``); False keeps it in
            high precision. None converts all.

    Returns:
        ``module`` (or, for a top-level Linear, the new Fp8Linear).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``config`` is of a wrong type, or
            ``module_filter_fn`` is not callable.
        ValueError: ``config`` is an unknown recipe name.

    Source: torchao ``convert_to_float8_training`` (API shape); DeepSeek-V3 report §3.3 (recipe).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    config = resolve_config(config)
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(
            f"module_filter_fn must be callable (mod, fqn) -> bool or None, "
            f"got {type(module_filter_fn).__name__}"
        )
    if not config.any_fp8:
        return module

    def wanted(mod: nn.Module, fqn: str) -> bool:
        if isinstance(mod, Fp8Linear) or not (isinstance(mod, nn.Linear) or _has_fp8_hook(mod)):
            return False
        return module_filter_fn is None or bool(module_filter_fn(mod, fqn))

    if isinstance(module, nn.Linear):
        return Fp8Linear.from_linear(module, config) if wanted(module, "") else module
    hooked: dict[int, tuple[nn.Module, str]] = {}
    if wanted(module, ""):
        hooked[id(module)] = (module, "")

    # Collect first, then swap, so the traversal never sees a half-converted tree.
    swaps: list[tuple[nn.Module, str, nn.Linear, str]] = []

    def visit(parent: nn.Module, prefix: str, seen: set[int]) -> None:
        # _modules, not named_children(): the latter hides a module's second name.
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Linear):
                swaps.append((parent, name, child, fqn))
            elif id(child) not in seen:
                seen.add(id(child))
                if wanted(child, fqn):
                    hooked[id(child)] = (child, fqn)
                visit(child, fqn, seen)

    visit(module, "", {id(module)})
    converted: dict[int, nn.Module] = {}
    for parent, name, child, fqn in swaps:
        if id(child) not in converted:
            converted[id(child)] = (
                Fp8Linear.from_linear(child, config) if wanted(child, fqn) else child
            )
        setattr(parent, name, converted[id(child)])
    for mod, _ in hooked.values():
        mod.enable_fp8(config)
    return module


def _has_fp8_hook(mod: nn.Module) -> bool:
    """Whether ``mod`` takes part in :func:`convert_to_fp8_training` through ``enable_fp8``."""
    return not isinstance(mod, nn.Linear) and callable(getattr(mod, "enable_fp8", None))
