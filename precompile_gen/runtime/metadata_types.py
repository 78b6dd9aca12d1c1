"""The type of what ``parse_metadata`` returns: each metadata constant by name,
with its annotation. Written from ``precompile_gen/metadata.py`` by
``scripts/regenerate.py``; do not edit."""

from typing import Any, TypedDict


class Metadata(TypedDict):
    """An artifact's metadata constants (an omitted optional one as the
    value its absence means)."""

    BACKEND: str
    MODULE_POSITIONS: list[int]
    NUM_POSITIONAL_ARGS: int
    ARGUMENT_NAMES: list[str]
    MODULE_TRAINING: list[list[bool]]
    MODULE_HOOKS: list[dict[str, dict[str, int]]]
    GLOBAL_MODULE_HOOKS: dict[str, int]
    PYTHON_VALUES: list[tuple[str, str]]
    PARAM_NAMES: list[str]
    BUFFER_NAMES: list[str]
    PARAM_SHAPES: list[tuple[int, ...]]
    BUFFER_SHAPES: list[tuple[int, ...]]
    PARAM_STRIDES: list[tuple[int, ...] | None]
    BUFFER_STRIDES: list[tuple[int, ...] | None]
    PARAM_DTYPES: list[str]
    BUFFER_DTYPES: list[str]
    PARAM_DEVICES: list[str]
    BUFFER_DEVICES: list[str]
    PARAM_REQUIRES_GRAD: list[bool]
    BUFFER_REQUIRES_GRAD: list[bool]
    GRAD_PARAM_INDICES: list[int]
    GRAD_RESETS: list[tuple[int, bool]]
    SKIPPABLE_STEP: bool
    STEP_RESETS: list[tuple[int, bool]]
    IN_SPEC: str | None
    OUT_SPEC: str
    PYTREE_TYPES: list[str]
    USER_INPUT_SHAPES: list[tuple[int | None, ...] | None]
    USER_INPUT_DTYPES: list[str | None]
    USER_INPUT_DEVICES: list[str | None]
    USER_INPUT_BOUNDS: list[dict[int, tuple[int | None, int | None]] | None]
    USER_INPUT_STRIDES: list[tuple[int, ...] | None]
    USER_INPUT_SYMBOLS: list[dict[int, str] | None]
    USER_INPUT_VALUES: list[bool | int | float | str | None]
    NUMBER_INPUTS: dict[int, str | None]
    INDEX_CHECKS: list[tuple[tuple[int, ...], tuple, int, int, int | None, str]]
    ALIASED_INPUTS: list[dict[int, tuple[int, tuple[int, ...]]]]
    MUTATED_INPUTS: list[int]
    KERNEL_BINARIES: dict[str, str]
    KERNEL_SOURCES: dict[str, str]
    OPTIMIZERS: list[dict[str, Any]]
    DTENSORS: dict[int, tuple[tuple[int, ...], tuple[str, ...]]]
    SHARD_INPUTS: dict[int, tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]]
    SHARD_OUTPUTS: dict[int, tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]]
    SCALAR_OUTPUTS: list[int]
    PROCESS_GROUPS: list[dict[str, Any]]
    DATA_PARALLEL: list[dict[str, Any]]
    SPARSE_GRADIENTS: list[int]
    DEFERRED_STEPS: list[dict[str, Any]]
