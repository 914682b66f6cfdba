"""The faces of interp's packages (`glassgpt.interp`, its `sae` and `sae.training`): public names
imported on first use (PEP 562), so that importing a package costs nothing until a name is
asked for, and a torch-free part (a dictionary's training settings) imports without the torch
modules beside it. This module imports nothing of glassgpt's: a face reads it while its own
package is being imported. (The package's own face, `glassgpt/__init__.py`, keeps its copy: it
may import nothing of the layers below it.)

    __getattr__, __dir__ = lazy_names(__name__, {"SAE": "glassgpt.interp.sae.model"})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, homes: Mapping[str, str], modules: Mapping[str, str] | None = None
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`: a name of `homes` (public name -> the
    module that defines it) is that module's attribute, a name of `modules` (name -> module)
    the module itself; each is imported the first time it is asked for and then kept in the
    package's namespace, so later lookups skip `__getattr__`."""
    modules = modules or {}
    namespace = sys.modules[package].__dict__

    def attribute(name: str) -> Any:
        if name in modules:
            value = importlib.import_module(modules[name])
        elif name in homes:
            value = getattr(importlib.import_module(homes[name]), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def listing() -> list[str]:
        return sorted(set(namespace) | set(homes) | set(modules))

    return attribute, listing
