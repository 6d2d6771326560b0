"""Prompts whose batches mix lengths and shared prefixes (two pairs share their first words), for tests that
compare the engine's tokens under two configurations."""

MIXED_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def quicksort(xs):\n    ",
    "The capital of France is Paris, and the capital of Germany is",
    "List three fruits:",
    "Once upon a time, in a small village by the sea, there lived a young girl named",
]
