"""docs/serving.md's generated tables: vLLM's flags and Pagoda's answers (vllm_compat), and the exit codes
(exit_codes.EXIT_CODES). `python -m pagoda.engine.cli.doc_tables` rewrites them in place; `--check` exits 1
where the page differs (a test runs the check)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from pagoda.engine.cli import vllm_compat
from pagoda.engine.cli.serve_args import implemented_flags
from pagoda.engine.exit_codes import exit_codes_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
_WORDS = {
    vllm_compat.IMPLEMENTED: "implemented",
    vllm_compat.IGNORED: "accepted, with a warning",
    vllm_compat.REFUSED: "refused",
}


def flags_table() -> str:
    rows = ["| vLLM flag | Pagoda | why, or what to use |", "|---|---|---|"]
    for name, answer in vllm_compat.table(implemented_flags()).items():
        kind = _WORDS[answer.kind]
        if answer.only:
            values = ", ".join(f"`{v}`" if v else '`""`' for v in answer.only)
            kind = f"accepted as {values}, with a warning; otherwise refused"
        note = answer.note
        if name in vllm_compat.FALLBACKS:
            fallback, why = vllm_compat.FALLBACKS[name]
            note = f"vLLM's other values are replaced by `{fallback}`, with a warning: {why}"
        note = note.replace("|", "\\|")
        rows.append(f"| `{name}` | {kind} | {note} |")
    return "\n".join(rows) + "\n"


TABLES = {"vllm-flags": flags_table, "exit-codes": exit_codes_table}


def render(text: str) -> str:
    for key, make in TABLES.items():
        pattern = re.compile(rf"(<!-- {key}:begin -->\n).*?(<!-- {key}:end -->)", re.DOTALL)
        if not pattern.search(text):
            raise ValueError(f"{DOC} has no <!-- {key}:begin --> ... <!-- {key}:end --> markers")
        text = pattern.sub(lambda m, make=make: m.group(1) + make() + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    fresh = render(text)
    if "--check" in argv:
        if fresh != text:
            print(f"{DOC} is out of date: run python -m pagoda.engine.cli.doc_tables", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
