"""The `pagoda` command: one entry point over both halves (pagoda.engine's and pagoda.operator's commands).

Neither half imports the other's command line: this package depends on both, they depend on neither.
"""
