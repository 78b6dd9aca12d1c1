"""The metadata constants' table (precompile_gen/metadata.py) is what section 2 of an
artifact holds: each constant a capture emits, in the table's order, with the table's
annotation, and an optional one only where the capture has what it records."""

from __future__ import annotations

import ast

import pytest
from helpers.stubs import STUBS, no_features_capture

import precompile_gen as pg
from precompile_gen import metadata
from precompile_gen.capture_result import BACKENDS, Backend

VARIANTS = [(backend, variant) for backend in BACKENDS for variant in STUBS]


def section_two(code: str) -> list[tuple[str, str]]:
    """The metadata constants the artifact assigns, in order, with annotations."""
    return [
        (node.target.id, ast.unparse(node.annotation))
        for node in ast.parse(code).body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and node.target.id in metadata.METADATA_NAMES
    ]


@pytest.mark.parametrize(("backend", "variant"), VARIANTS)
def test_section_two_assigns_the_emitted_constants_in_the_tables_order(
    backend: Backend, variant: str
) -> None:
    cap = STUBS[variant](backend)
    constants = metadata.emitted(metadata.metadata_constants(cap))
    assert section_two(pg.render_artifact(cap)) == [
        (constant.name, ast.unparse(ast.parse(constant.annotation, mode="eval").body))
        for constant in constants
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_capture_without_features_emits_only_the_required_constants(
    backend: Backend,
) -> None:
    code = pg.render_artifact(no_features_capture(backend))
    assert [name for name, _ in section_two(code)] == list(metadata.REQUIRED_NAMES)
    parsed: dict[str, object] = dict(pg.parse_metadata(code))
    for name, default in metadata.OPTIONAL_METADATA.items():
        assert parsed[name] == default, name


def test_a_constant_shown_with_another_is_emitted_with_it_whatever_its_value() -> None:
    values = dict(metadata.OPTIONAL_METADATA, SKIPPABLE_STEP=True)
    names = [constant.name for constant in metadata.emitted(values)]
    # A step that skips without resets of its own still says it resets nothing.
    assert values["STEP_RESETS"] == []
    assert [name for name in names if name in ("SKIPPABLE_STEP", "STEP_RESETS")] == [
        "SKIPPABLE_STEP",
        "STEP_RESETS",
    ]
    assert "SHARD_OUTPUTS" not in names


def test_every_companion_is_an_optional_constant_before_it() -> None:
    position = {name: i for i, name in enumerate(metadata.METADATA_NAMES)}
    for constant in metadata.CONSTANTS:
        if constant.shown_with is not None:
            companion = metadata.CONSTANTS[position[constant.shown_with]]
            assert constant.optional and companion.optional, constant.name
            assert position[constant.shown_with] < position[constant.name]
