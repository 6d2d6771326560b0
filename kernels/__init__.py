"""Triton kernels for paged attention and their pure-torch reference twins."""

if __name__ != "pagoda.kernels":  # imported by its bare folder name from the repository root
    raise ImportError("this folder is the package 'pagoda.kernels'; it has no bare name 'kernels'")
