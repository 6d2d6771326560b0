"""Sizing is pure Python: the operator image has no torch."""

import subprocess


def test_sizing_imports_without_torch(python):
    code = (
        "import sys\n"
        "import pagoda.engine.sizing as s\n"
        "import pagoda.engine.cli.plan\n"
        "s.plan(s.well_known_shape('Llama-3.1-8B'), s.gpu_info('H100'))\n"
        "heavy = [m for m in ('torch', 'numpy', 'transformers', 'triton', 'gguf') if m in sys.modules]\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "[]"
