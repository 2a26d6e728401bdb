"""Tests of ptxtrain.moe: routing, permutation and the MoE layer."""
