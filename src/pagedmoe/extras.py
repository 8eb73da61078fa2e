"""Optional packages (the extras of pyproject.toml): a feature whose package is missing fails in one line that
names the extra to install, checked before the long work starts (an evaluation, a sweep, loading a model)."""
from __future__ import annotations

import importlib.util


class MissingPackageError(ImportError):
    """An optional package a feature needs is not installed; the message says which extra brings it."""


def has_package(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a dotted name whose parent is missing
        return False


def require(module: str, extra: str, feature: str, package: str | None = None) -> None:
    """Raise MissingPackageError unless `module` can be imported (`package`: its name on PyPI, when another)."""
    if not has_package(module):
        raise MissingPackageError(f"{feature} needs the '{package or module}' package, which is not installed: "
                                  f"pip install 'pagedmoe[{extra}]' (in a checkout: bash scripts/install.sh {extra})")
