"""Checkpoint input/output: safetensors files and the K3 / Kimi Linear tensor naming."""
