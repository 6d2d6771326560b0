"""The Kubernetes operator: kopf handlers, rendering of child objects, GPU discovery."""

if __name__ != "pagoda.operator":  # pragma: no cover - only when the repository root is on sys.path
    # Imported by its bare folder name (a script or `python -c` run in the repository root, or a child that
    # multiprocessing's spawn starts there): become the standard library's `operator` instead of shadowing
    # it. This can run in the middle of the interpreter's start-up (`collections` imports operator while
    # `threading` or `functools` are half-initialised), so it imports nothing: the import system's own
    # modules are already loaded, and the stdlib's operator.py needs only builtins and _operator.
    import sys as _sys

    _bootstrap = _sys.modules["_frozen_importlib"]
    _external = _sys.modules["_frozen_importlib_external"]
    _stdlib = getattr(_sys, "_stdlib_dir", None) or _sys.modules["os"].path.dirname(
        _sys.modules["os"].__file__
    )
    _spec = _bootstrap.spec_from_loader(
        "operator", _external.SourceFileLoader("operator", _external._path_join(_stdlib, "operator.py"))
    )
    _std = _bootstrap.module_from_spec(_spec)
    _sys.modules["operator"] = _std
    _spec.loader.exec_module(_std)
