"""Inputs every quantization backend must reject exactly as the reference does:
``(x, block, exception type)``."""

import torch

BAD_INPUTS = [
    (torch.zeros(4, 4, dtype=torch.int32), 128, TypeError),
    ([[1.0]], 128, TypeError),
    (torch.zeros(2, 3, 4), 128, ValueError),
    (torch.zeros(4, 4), 0, ValueError),
    (torch.zeros(4, 4), True, ValueError),
]
