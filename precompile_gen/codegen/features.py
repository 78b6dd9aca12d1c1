"""The driver's features: what of section 3 and the runtime support a capture needs.

Each feature is one entry of ``FEATURES``: its name, what in the capture calls for
it, and the runtime support's parts its steps call. Its steps are written where they
run, in forward() (``driver/forward.py.j2``) and the header, under
``{% if features.<name> %}``: the entry is the feature, the template lines are its
use. An artifact carries only the checks and the work its capture calls for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from precompile_gen.capture_result import CaptureResult


class Feature(NamedTuple):
    """One feature of the driver."""

    name: str
    # Whether a capture has it.
    applies: Callable[[CaptureResult], bool]
    # The runtime support's parts (``render.RUNTIME_PARTS``) its steps call, carried
    # by the artifacts with it.
    parts: tuple[str, ...] = ()


def _state_layouts(cap: CaptureResult) -> bool:
    # Inductor's strides on the module state and the optimizers' state.
    strides = cap.graph.input_strides
    state = [*strides.params, *strides.buffers, *strides.optimizer_state]
    return cap.backend == "inductor" and any(stride is not None for stride in state)


def _leaf_layouts(cap: CaptureResult) -> bool:
    # Inductor's strides on the input leaves: the driver copies a leaf passed in
    # another layout into the captured one.
    leaves = cap.graph.input_strides.leaves
    return cap.backend == "inductor" and any(stride is not None for stride in leaves)


def _tensor_arguments(cap: CaptureResult) -> bool:
    # Every non-module argument is one tensor (no nesting, no other values): the
    # driver splits the call without flattening it.
    conv = cap.convention
    return conv.in_tree.flat and all(leaf.shape is not None for leaf in conv.leaves)


FEATURES: tuple[Feature, ...] = (
    # The backend's graph: the compiled graph (inductor) or the captured ATen graph.
    Feature("compiled", lambda cap: cap.backend == "inductor", ("compiled_graph",)),
    Feature("captured", lambda cap: cap.backend == "eager", ("captured_graph",)),
    Feature("tensor_arguments", _tensor_arguments),
    # bool/int/float/str leaves built into the graph (the header says so).
    Feature(
        "values",
        lambda cap: any(leaf.value is not None for leaf in cap.convention.leaves),
    ),
    # mark_unbacked dims: their bounds, and dims that must share a size.
    Feature(
        "dynamic_dims", lambda cap: any(leaf.bounds for leaf in cap.convention.leaves)
    ),
    Feature(
        "shared_sizes", lambda cap: any(leaf.symbols for leaf in cap.convention.leaves)
    ),
    # Namedtuple and dataclass types the specs name, imported when loaded.
    Feature(
        "pytree_types", lambda cap: bool(cap.convention.pytree_types), ("pytree_types",)
    ),
    # Dicts among the inputs, which a call may pass with their keys in another order.
    Feature(
        "dict_inputs", lambda cap: cap.convention.in_tree.holds_dicts, ("dict_inputs",)
    ),
    # Inputs that shared a storage at capture.
    Feature("aliasing", lambda cap: bool(cap.convention.aliased_inputs)),
    # Inputs the graph updates in place: an inference tensor passed there is refused,
    # as eager refuses to write to it.
    Feature("inference_writes", lambda cap: bool(cap.convention.mutated_inputs)),
    Feature("state_layouts", _state_layouts, ("layouts",)),
    Feature("leaf_layouts", _leaf_layouts, ("layouts",)),
    Feature(
        "gradients", lambda cap: bool(cap.convention.grad_param_indices), ("gradients",)
    ),
    Feature(
        "grad_resets", lambda cap: bool(cap.convention.grad_resets), ("gradients",)
    ),
    # Optimizer arguments whose state and lr the graph takes.
    Feature("optimizers", lambda cap: bool(cap.convention.optimizers), ("optimizers",)),
    # Outputs the function returned as t.item(), which the driver converts.
    Feature("scalar_outputs", lambda cap: bool(cap.convention.scalar_outputs)),
    # Collectives over process groups, and DistributedDataParallel arguments.
    Feature(
        "process_groups",
        lambda cap: bool(cap.convention.process_groups),
        ("process_groups",),
    ),
    Feature(
        "data_parallel",
        lambda cap: bool(cap.convention.data_parallel),
        ("process_groups",),
    ),
    # DTensor graph inputs, whose mesh shapes and placements the driver checks.
    Feature("dtensors", lambda cap: bool(cap.convention.dtensors), ("dtensors",)),
    # The graph takes DTensor inputs' local shards and returns its DTensor results'
    # (inductor), which the driver unwraps and wraps.
    Feature(
        "local_shards", lambda cap: cap.graph.local_shards is not None, ("dtensors",)
    ),
    # Sparse gradients the driver builds from the graph's outputs, and the optimizer
    # steps it takes for them after the graph.
    Feature(
        "sparse_gradients", lambda cap: cap.convention.sparse_gradients is not None
    ),
    Feature(
        "deferred_steps",
        lambda cap: bool(cap.convention.deferred_steps),
        ("deferred_steps",),
    ),
    # Indices the graph takes from input leaves, checked against their range.
    Feature(
        "index_checks", lambda cap: bool(cap.convention.index_checks), ("index_checks",)
    ),
    # Tensors the function created from Python data, fed to the graph after the
    # input leaves.
    Feature("tensor_literals", lambda cap: bool(cap.graph.tensor_literals)),
    # Float leaves the graph takes as 0-dim float64 tensors (NUMBER_INPUTS).
    Feature(
        "number_inputs", lambda cap: any(leaf.number for leaf in cap.convention.leaves)
    ),
    # Branches on tensor values in the graph: it may refuse a call's side, so the
    # .grad resets wait for it. A path through them that skips the step
    # (SKIPPABLE_STEP), and resets of the step's own (STEP_RESETS).
    Feature("value_branches", lambda cap: bool(cap.convention.value_branches)),
    Feature(
        "skippable_step",
        lambda cap: cap.convention.skippable_step,
        ("gradients", "skipped_steps"),
    ),
    Feature("step_resets", lambda cap: bool(cap.convention.step_resets)),
)
FEATURE_NAMES = frozenset(feature.name for feature in FEATURES)


@dataclass(frozen=True)
class DriverFeatures:
    """The features a capture has: ``features.gradients`` and the like, by their
    names in ``FEATURES``, read by the templates and the plan."""

    names: frozenset[str]

    def __post_init__(self) -> None:
        unknown = self.names - FEATURE_NAMES
        if unknown:
            raise ValueError(
                f"unknown driver features {sorted(unknown)}: a feature is an entry of "
                "FEATURES in precompile_gen/codegen/features.py."
            )

    def __getattr__(self, name: str) -> bool:
        # Only for names that are not attributes: a feature's, or a mistake, which
        # the templates' StrictUndefined reports.
        if name not in FEATURE_NAMES:
            raise AttributeError(
                f"no driver feature is named {name!r}: add its entry to FEATURES "
                "in precompile_gen/codegen/features.py, or read one it has."
            )
        return name in self.names

    def parts(self) -> set[str]:
        """The runtime support's parts these features' steps call."""
        return {
            part
            for feature in FEATURES
            if feature.name in self.names
            for part in feature.parts
        }


def driver_features(cap: CaptureResult) -> DriverFeatures:
    """The features ``cap``'s driver has."""
    return DriverFeatures(
        frozenset(feature.name for feature in FEATURES if feature.applies(cap))
    )
