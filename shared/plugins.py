"""User code named by import path ('pkg.module:function' or 'file.py:function'): reward functions,
advantage estimators and policy losses plug in this way, as verl's registries do, without a registry."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any


def load_callable(spec: str, what: str = "function") -> Any:
    """'pkg.module:function' or '/path/to/file.py:function' -> the function; a ValueError naming `what` and
    the spec when it does not resolve or is not callable."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"{what} {spec!r} must look like 'pkg.module:function' or 'file.py:function'")
    try:
        if target.endswith(".py") or "/" in target:
            path = Path(target).expanduser()
            if not path.is_file():
                raise ImportError(f"no such file {path}")
            module_spec = importlib.util.spec_from_file_location(f"rlbus_user_{path.stem}", path)
            if module_spec is None or module_spec.loader is None:
                raise ImportError(f"cannot load {path} as a Python module")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        fn = getattr(module, attr)
    except Exception as exc:  # noqa: BLE001 - user code can raise anything at import; say which spec
        raise ValueError(f"cannot load {what} {spec!r}: {type(exc).__name__}: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"{what} {spec!r} is not callable")
    return fn


def is_import_path(name: str) -> bool:
    """A config value that names user code rather than a built-in ('pkg.mod:fn', 'file.py:fn')."""
    return ":" in name
