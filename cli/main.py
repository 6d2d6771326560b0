"""The `pagoda` command: a thin dispatcher that imports only the subcommand it runs.

It sits above both halves: serve, generate, plan and kernels are the engine's (pagoda.engine.cli), render
is the operator's (pagoda.operator.render_cli), and neither package imports the other's command line.
`pagoda render` and `pagoda plan` must work where only `pagoda[operator]` is installed (no torch), so
nothing heavy is imported here.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with `main(argv) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pagoda.engine.cli.serve", "serve a model over an OpenAI-compatible HTTP API"),
    "generate": ("pagoda.engine.cli.generate", "generate a completion for a prompt and print it"),
    "plan": ("pagoda.engine.cli.plan", "size the KV cache and engine settings for a model on a GPU"),
    "kernels": (
        "pagoda.engine.cli.kernels",
        "compile the GPU kernels ahead of time, without a GPU (warm); the CPU kernels of this host (info)",
    ),
    "render": ("pagoda.operator.render_cli", "print the Kubernetes objects an InferenceDeployment becomes"),
    "router": ("pagoda.router.main", "route requests across replicas by their cached KV (docs/router.md)"),
}


def _usage() -> str:
    lines = ["usage: pagoda <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "Run `pagoda <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from importlib.metadata import version

        print(f"pagoda {version('pagoda')}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        import difflib

        close = difflib.get_close_matches(name, SUBCOMMANDS, n=3)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        print(f"pagoda: unknown command {name!r}.{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
