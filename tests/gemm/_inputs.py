"""Random GEMM operands shared by the FP8 GEMM backend tests."""

import torch


def scaled_operands(m: int, n: int, k: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] and w [N, K] float32 whose rows and 128-column blocks differ in magnitude (so a
    wrong per-row, per-K-block or per-N-block scale shows)."""
    g = torch.Generator().manual_seed(seed)
    kb = -(-k // 128)
    row_gain = torch.exp(torch.randn(m, 1, generator=g))  # [M, 1]
    w_block_gain = torch.exp(torch.randn(-(-n // 128), 1, generator=g)).repeat_interleave(128, 0)
    k_block_gain = torch.exp(torch.randn(kb, generator=g)).repeat_interleave(128)[:k]  # [K]
    x = torch.randn(m, k, generator=g) * row_gain * k_block_gain
    w = torch.randn(n, k, generator=g) * w_block_gain[:n]
    return x.to(device), w.to(device)
