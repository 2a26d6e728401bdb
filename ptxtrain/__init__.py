"""ptxtrain: DeepSeek-V3's training-efficiency stack for Hopper GPUs, with a CPU reference path."""

__version__ = "0.1.0"
