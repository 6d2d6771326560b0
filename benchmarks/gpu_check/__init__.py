"""`make gpu-check`: one command that checks Pagoda on whatever GPU machine it is run on, in under 8 minutes.

Runs from a clean checkout with the machine's own `python3`, torch and Triton (no `make install`, no
package index): the checkout is imported through a shim folder (pagoda.engine -> engine/, ... as setup.py
maps them) and the few packages the machine lacks are installed from wheels carried in `.whl/`
(`make gpu-check-prepare` fills it) into a temporary folder. Each step runs in a process of its own under
its own time budget; the JSON says which passed. Entry point: benchmarks/gpu_check/main.py.
"""
