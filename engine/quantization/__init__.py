"""Quantized checkpoints: what a checkpoint's quantization is (scheme, detect), how its linears hold and run
their weights (linear, convert; GGUF blocks in gguf_linear).

This package's own import stays light (no torch): the planner and the operator read `scheme` and `detect`
through engine/sizing, and the operator never imports torch. Import the torch modules by their own names.
"""
