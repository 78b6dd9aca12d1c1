# Runtime support for namedtuple and dataclass types among the inputs and results:
# carried after the base part (precompile_gen/runtime_support/support.py) by every
# artifact whose specs name such types, from its first "# ---" heading on. The lines
# above that heading are not carried: they import what the base part defines, so that
# ruff and pyrefly check this part as a module of its own.
from precompile_gen.runtime_support.support import _fail

# isort: split

# --- Namedtuple and dataclass types -------------------------------------------------
import dataclasses
import importlib
from typing import Any

from torch.utils import _pytree as pytree


def import_pytree_type(path: str) -> Any:
    """The class at ``path`` ("module:qualname"), importing its module."""
    module_name, _, qualname = path.partition(":")
    found: Any = importlib.import_module(module_name)
    for name in qualname.split("."):
        found = getattr(found, name)
    return found


def register_pytree_type(cls: Any, path: str) -> None:
    """Have tree specs name ``cls``, a namedtuple or dataclass, by ``path``; and
    have pytree open a dataclass into its init fields, as torch.export's
    ``register_dataclass`` does (a type registered already is left as it is)."""
    if dataclasses.is_dataclass(cls):
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(cls, serialized_type_name=path)
    elif cls not in pytree.SUPPORTED_SERIALIZED_TYPES:
        pytree._register_namedtuple(cls, serialized_type_name=path)


def _register_pytree_types(paths: list[str]) -> None:
    for path in paths:
        try:
            cls = import_pytree_type(path)
        except (ImportError, AttributeError) as error:
            _fail(
                f"the traced function's inputs or result hold the type {path}, which "
                f"this artifact rebuilds, but it cannot be imported here ({error}). "
                "Import the module that defines it before loading (a type defined in "
                "the capturing script's __main__ must be defined in the loading "
                "script's too), or capture again with a tuple or dict instead."
            )
        register_pytree_type(cls, path)


# Executed with the artifact, before the calls part reads the specs that name them.
_register_pytree_types(globals().get("PYTREE_TYPES", []))
