"""Small helpers shared by the benchmark scripts: results folder, table printing, JSON and plots."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    payload = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n{title}")
    print("| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def plot_path(name: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    return RESULTS / f"{name}.png"


def pyplot():
    """matplotlib's pyplot without a display, or None (and a note) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    return plt


def save_plot(fig, name: str) -> None:
    """Lay ``fig`` out and write it to bench-results/NAME.png."""
    fig.tight_layout()
    path = plot_path(name)
    fig.savefig(path)
    print(f"wrote {path}")
