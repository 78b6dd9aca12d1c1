# Runtime support for dict inputs, which a call may pass with their keys in another
# order: carried after the base part (precompile_gen/runtime_support/support.py) by
# every artifact whose inputs hold dicts, from its first "# ---" heading on, before the
# calls part, which takes it up. The lines above that heading are not carried: they
# import what the other parts and the rest of the artifact define, so that ruff and
# pyrefly check this part as a module of its own.
from precompile_gen.runtime_support.calls import _IN_SPEC
from precompile_gen.runtime_support.declarations import _USER_POSITIONS, ARGUMENT_NAMES
from precompile_gen.runtime_support.support import _argument, _fail, _listed

# isort: split

# --- Dicts in another key order -----------------------------------------------------
import warnings
from typing import cast

from torch.utils import _pytree as pytree

# Whether a call's dict has come in another key order yet, which is said once.
_reordered_once = False


def _in_example_order(user_inputs: tuple[object, ...]) -> tuple[object, ...]:
    """The inputs with each dict's keys in the order of the example's, in which the
    graph takes their values; a dict with other keys than the example's is refused."""
    assert _IN_SPEC is not None
    specs = _IN_SPEC.children()
    if len(specs) != len(user_inputs):
        return user_inputs
    return tuple(
        _reordered(argument, spec, position, "")
        for argument, spec, position in zip(user_inputs, specs, _USER_POSITIONS)
    )


def _reordered(tree: object, spec: pytree.TreeSpec, position: int, path: str) -> object:
    if spec.is_leaf() or pytree.tree_is_leaf(tree):
        return tree
    if spec.type is dict and type(tree) is dict:
        keys = cast(list[object], spec.context)
        if tree.keys() != set(keys):
            where = _argument(position, ARGUMENT_NAMES, path)
            _fail(_keys_message(where, list(tree), keys))
        return {
            key: _reordered(tree[key], child, position, f"{path}[{key!r}]")
            for key, child in zip(keys, spec.children())
        }
    node = pytree.SUPPORTED_NODES[pytree._get_node_type(tree)]
    children, context = node.flatten_fn(tree)
    if node.type is not spec.type or len(children) != spec.num_children:
        return tree  # another structure, which the caller reports
    keys = (
        [pytree.keystr((key,)) for key, _ in node.flatten_with_keys_fn(tree)[0]]
        if node.flatten_with_keys_fn is not None
        else [f"[{index}]" for index in range(len(children))]
    )
    return node.unflatten_fn(
        [
            _reordered(child, child_spec, position, path + key)
            for child, child_spec, key in zip(children, spec.children(), keys)
        ],
        context,
    )


def _keys_message(where: str, got: list[object], expected: list[object]) -> str:
    missing = [key for key in expected if key not in got]
    extra = [key for key in got if key not in expected]
    differences = [f"lacks the key(s) {_listed(missing)}"] if missing else []
    if extra:
        differences.append(
            f"has the key(s) {_listed(extra)}, which the example did not"
        )
    return (
        f"{where} {' and '.join(differences)}: a dict input matches the example's by "
        "key, in any order, and the graph was traced for the keys "
        f"{_listed(expected)}. Pass a dict with exactly those keys, or capture again "
        "with these."
    )


def _flatten_in_example_order(
    user_inputs: tuple[object, ...],
) -> tuple[list[object], pytree.TreeSpec]:
    global _reordered_once
    leaves, spec = pytree.tree_flatten(_in_example_order(user_inputs))
    if spec == _IN_SPEC and not _reordered_once:
        _reordered_once = True
        warnings.warn(
            "a dict input's keys came in another order than the example's: the "
            "artifact takes its values by key, in the example's order, which is the "
            "order the traced function saw (a function whose result depends on the "
            "order of a dict's keys computes as it did for the example's). "
            "(Said once per artifact.)",
            stacklevel=5,
        )
    return leaves, spec
