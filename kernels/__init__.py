"""Triton kernels for paged attention and their pure-torch reference twins."""

if __name__ != "pagoda.kernels":  # pragma: no cover - only when the repository root is on sys.path
    # Imported by its bare folder name (e.g. `python -c` run in the repository root). Hugging Face's
    # transformers probes for a package called `kernels`; look like an empty namespace package, which it
    # treats as absent, and expose none of our code under this name.
    del globals()["__file__"]
