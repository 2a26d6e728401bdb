"""Tests of ptxtrain.ep: the expert-parallel Buffer, its NVLink kernel and layout helpers."""
