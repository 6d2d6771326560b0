"""The Kubernetes operator: kopf handlers, rendering of child objects, GPU discovery."""

if __name__ != "pagoda.operator":  # pragma: no cover - only when the repository root is on sys.path
    # Imported by its bare folder name: hand back the standard library's `operator` instead of shadowing it.
    import importlib.util as _util
    import os as _os
    import sys as _sys
    import sysconfig as _sysconfig

    _spec = _util.spec_from_file_location(
        "operator", _os.path.join(_sysconfig.get_paths()["stdlib"], "operator.py")
    )
    _std = _util.module_from_spec(_spec)
    _sys.modules["operator"] = _std
    _spec.loader.exec_module(_std)
