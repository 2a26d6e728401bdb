"""Tests of ptxtrain.model: config, presets and the DeepSeek-V3-style model."""
