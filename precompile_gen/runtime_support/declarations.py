# The names the runtime support's parts read from the rest of the artifact, declared
# with the types the artifact gives them, so that ruff and pyrefly check each part as
# a module of its own. Never carried: in an artifact, the metadata constants (section
# 2, the constants its capture has) and section 3's convention constants are these
# names, and tests hold this file to the annotations the templates render.
from typing import Any

import torch

# Section 1: the tensor literals the graph takes.
TENSOR_LITERALS: list[torch.Tensor]

# Section 2: the calling-convention metadata (written from precompile_gen/metadata.py by
# scripts/regenerate.py).
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

# Section 3: this capture's convention beyond the metadata.
_USER_POSITIONS: list[int]
_SIGNATURE: str
_TENSOR_ARGUMENTS: bool
