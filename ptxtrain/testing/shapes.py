"""Shape grids: the DeepSeek-V3 GEMM shapes (DeepGEMM's benchmark list) plus awkward ones.

Tests and benchmarks import these lists; nobody copies them. ``scaled_down`` shrinks a shape so
the CPU reference path runs it in a test while keeping its tails (N, K mod 128) intact.
"""

from __future__ import annotations

# (N, K) of the dense DeepSeek-V3 projections (y = x Wᵀ with W [N, K]).
DSV3_DENSE_NK: tuple[tuple[int, int], ...] = (
    (2112, 7168),  # fused q_a + kv_a down-projection (1536 + 512 + 64)
    (24576, 1536),  # q_b up-projection: 128 heads x 192
    (32768, 512),  # kv_b up-projection: 128 heads x 256
    (7168, 16384),  # o_proj
    (4096, 7168),  # MoE expert gate+up (2 x 2048)
    (7168, 2048),  # MoE expert down
)
# Extra DeepSeek-V3 shape with an N tail (576 = 4.5 x 128).
DSV3_EXTRA_NK: tuple[tuple[int, int], ...] = ((576, 7168),)

# M values of the benchmarks: decode-sized and a training micro-batch of tokens.
DSV3_M: tuple[int, ...] = (64, 128, 4096)

# Awkward sizes every kernel must take: empty, single row, odd, tails around 128.
AWKWARD_M: tuple[int, ...] = (0, 1, 13, 127, 129)
AWKWARD_NK: tuple[tuple[int, int], ...] = (
    (1, 1),
    (13, 100),
    (100, 13),
    (128, 128),
    (129, 257),
    (200, 384),
    (576, 200),
)

# Wgrad (1D1D) pairs: dW [N, K] = dyᵀ[N, M] · xᵀ[K, M]; K here is the token count.
DSV3_WGRAD_MN: tuple[tuple[int, int], ...] = tuple((k, n) for n, k in DSV3_DENSE_NK)
DSV3_WGRAD_K: tuple[int, ...] = (4096, 8192)


def scaled_down(dim: int, factor: int = 16, floor: int = 128) -> int:
    """Shrink ``dim`` by ``factor`` for CPU tests, keeping ``dim % 128`` (its tail) unchanged.

    >>> scaled_down(7168), scaled_down(2112), scaled_down(576)
    (384, 192, 192)
    """
    tail = dim % 128
    blocks = dim // 128
    small = max(floor // 128, blocks // factor)
    return small * 128 + tail


def dense_shapes_cpu(factor: int = 16) -> list[tuple[int, int]]:
    """The DeepSeek-V3 (N, K) shapes scaled down for the CPU, tails kept."""
    return [
        (scaled_down(n, factor), scaled_down(k, factor)) for n, k in DSV3_DENSE_NK + DSV3_EXTRA_NK
    ]
