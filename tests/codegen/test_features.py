"""The driver's features table: each entry is the whole feature, its steps are its
uses in the templates, and the runtime support's parts follow from it."""

from __future__ import annotations

import re

import pytest
from helpers.golden import CASES

from precompile_gen.codegen.features import (
    FEATURE_NAMES,
    FEATURES,
    DriverFeatures,
    driver_features,
)
from precompile_gen.codegen.render import (
    BASE_PARTS,
    RUNTIME_PARTS,
    runtime_parts,
    template_dir,
)

_READ = re.compile(r"\bfeatures\.(\w+)")


def _template_reads() -> dict[str, set[str]]:
    """Each template's reads of ``features.<name>``, by its path."""
    return {
        str(path.relative_to(template_dir())): set(
            _READ.findall(path.read_text(encoding="utf-8"))
        )
        for path in sorted(template_dir().rglob("*.j2"))
    }


def test_templates_read_only_features_the_table_declares() -> None:
    for template, names in _template_reads().items():
        assert names <= FEATURE_NAMES, (template, names - FEATURE_NAMES)


def test_every_feature_has_a_step_or_a_runtime_part() -> None:
    read = set().union(*_template_reads().values())
    for feature in FEATURES:
        assert feature.name in read or feature.parts, feature.name


def test_each_runtime_part_is_carried_for_a_feature_or_by_every_artifact() -> None:
    named = {part for feature in FEATURES for part in feature.parts}
    assert named <= set(RUNTIME_PARTS)
    assert set(RUNTIME_PARTS) == named | set(BASE_PARTS)
    assert len(FEATURE_NAMES) == len(FEATURES)


def test_parts_follow_the_features_in_the_artifact_order() -> None:
    features = DriverFeatures(frozenset({"optimizers", "compiled", "grad_resets"}))
    assert runtime_parts(features) == (
        "support",
        "gradients",
        "calls",
        "optimizers",
        "compiled_graph",
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_golden_carries_the_parts_of_its_features(name: str) -> None:
    cap = CASES[name]()
    features = driver_features(cap)
    parts = runtime_parts(features)
    assert ("compiled_graph" in parts) == (cap.backend == "inductor")
    assert ("captured_graph" in parts) == (cap.backend == "eager")
    assert features.compiled != features.captured


def test_a_name_outside_the_table_is_an_error_not_false() -> None:
    features = DriverFeatures(frozenset({"gradients"}))
    assert features.gradients and not features.optimizers
    with pytest.raises(AttributeError) as missing:
        _ = features.gradient
    for text in ("no driver feature is named 'gradient'", "add its entry to FEATURES"):
        assert text in str(missing.value)
    with pytest.raises(ValueError) as unknown:
        DriverFeatures(frozenset({"gradient"}))
    for text in ("unknown driver features ['gradient']", "an entry of FEATURES"):
        assert text in str(unknown.value)
