"""Tensor parallelism: the rank group, the model shards' collectives and the worker processes."""
