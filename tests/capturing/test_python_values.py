"""Python state as the calling convention: the values a trace reads are recorded and
checked at every call; writes to Python state and Python/NumPy random draws are
refused at capture, naming the user's line."""

from __future__ import annotations

import copy
import enum
import logging
import random
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.state_snapshot import StateSnapshot
from torch import nn

import precompile_gen as pg

SCALE = 1.0
COUNT = 0
HISTORY: list[int] = []


class Config:
    """A plain config object, as model libraries keep them."""

    def __init__(self) -> None:
        self.output_scaled = True
        self.dtype = torch.float32
        self.sizes = (2, 4)


class Mode(enum.Enum):
    SUM = "sum"
    MEAN = "mean"


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.0)
        self.temperature = 1.0
        self.use_skip = True
        self.config = Config()
        self.mode = Mode.SUM
        self.bookkeeping = 0  # never read by forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.lin(x.to(self.config.dtype))) / self.temperature
        y = y + x if self.use_skip else y
        if self.config.output_scaled:
            y = y * 2
        y = y.reshape(self.config.sizes)
        return y.sum(0) if self.mode is Mode.SUM else y.mean(0)


def scaled(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x) * SCALE


def example() -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=["eager", "inductor"])
def loaded(request: pytest.FixtureRequest) -> Callable[..., object]:
    code, cache = pg.precompile(scaled, Scaled(), example(), backend=request.param)
    return pg.load(code, cache)


def test_the_values_read_are_recorded_with_their_paths() -> None:
    cap = pg.capture(scaled, Scaled(), example(), backend="eager")
    values = dict(cap.convention.python_values)
    assert values == {
        "argument 0: .config.dtype": "torch.float32",
        "argument 0: .config.output_scaled": "True",
        "argument 0: .config.sizes": "(2, 4)",
        "argument 0: .drop.inplace": "False",
        "argument 0: .drop.p": "0.0",
        "argument 0: .mode": "<Mode.SUM: 'sum'>",
        "argument 0: .temperature": "1.0",
        "argument 0: .use_skip": "True",
        f"global SCALE (module {__name__})": "1.0",
    }
    text = pg.render_artifact(cap)
    parsed = pg.parse_metadata(text)["PYTHON_VALUES"]
    assert dict(parsed) == values


@pytest.mark.parametrize(
    ("where", "attribute", "changed"),
    [
        ("argument 0 (`model.temperature`)", "temperature", 2.0),
        ("argument 0 (`model.use_skip`)", "use_skip", False),
        ("argument 0 (`model.drop.p`)", "drop.p", 0.5),
        ("argument 0 (`model.config.output_scaled`)", "config.output_scaled", False),
        ("argument 0 (`model.config.dtype`)", "config.dtype", torch.float64),
        ("argument 0 (`model.mode`)", "mode", Mode.MEAN),
        ("argument 0 (`model.temperature`)", "temperature", 1),  # an int for the float
    ],
)
def test_a_changed_value_is_rejected_and_matches_eager_once_set_back(
    loaded: Callable[..., object], where: str, attribute: str, changed: object
) -> None:
    model, x = Scaled(), example()
    torch.testing.assert_close(loaded(model, x), scaled(model, x))
    torch.testing.assert_close(loaded(model, x), scaled(model, x))  # fast path
    *parents, name = attribute.split(".")
    holder = model
    for parent in parents:
        holder = getattr(holder, parent)
    traced = getattr(holder, name)
    setattr(holder, name, changed)
    snapshot = StateSnapshot(model, x)
    with pytest.raises(pg.PrecompileError) as error:
        loaded(model, x)
    message = str(error.value)
    assert f"at {where} is {changed!r}" in message
    assert f"it was {traced!r} when the function was traced" in message
    assert "Set it back" in message and "capture again" in message
    snapshot.assert_unchanged()
    setattr(holder, name, traced)
    torch.testing.assert_close(loaded(model, x), scaled(model, x))


def test_a_changed_global_is_rejected(loaded: Callable[..., object]) -> None:
    global SCALE
    model, x = Scaled(), example()
    loaded(model, x)
    SCALE = 3.0
    try:
        with pytest.raises(pg.PrecompileError, match=r"global SCALE .* is 3\.0"):
            loaded(model, x)
    finally:
        SCALE = 1.0
    torch.testing.assert_close(loaded(model, x), scaled(model, x))


def test_an_unread_attribute_changes_nothing(loaded: Callable[..., object]) -> None:
    model, x = Scaled(), example()
    loaded(model, x)
    model.bookkeeping += 1
    vars(model)["new_attribute"] = "anything"
    vars(model.config)["unread"] = [1, 2]
    torch.testing.assert_close(loaded(model, x), scaled(model, x))


def test_a_replaced_config_object_is_checked_on_the_fast_path(
    loaded: Callable[..., object],
) -> None:
    model, x = Scaled(), example()
    loaded(model, x)
    loaded(model, x)
    other = Config()
    other.sizes = (4, 2)
    model.config = other
    with pytest.raises(
        pg.PrecompileError, match=r"\(`model\.config\.sizes`\) is \(4, 2\)"
    ):
        loaded(model, x)


def _module_with_a_global() -> types.ModuleType:
    # Code in another module, reading that module's global.
    module = types.ModuleType("pv_library")
    exec(
        "import torch\nFACTOR = 2.0\ndef scale(x):\n    return x * FACTOR\n",
        module.__dict__,
    )
    sys.modules[module.__name__] = module
    return module


def test_a_global_of_the_code_fn_calls_is_checked() -> None:
    library = _module_with_a_global()

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return library.scale(model(x))

    model, x = nn.Linear(4, 4), example()
    cap = pg.capture(step, model, x, backend="eager")
    assert ("global FACTOR (module pv_library)", "2.0") in cap.convention.python_values
    loaded = pg.load(pg.render_artifact(cap), b"")
    torch.testing.assert_close(loaded(model, x), step(model, x))
    vars(library)["FACTOR"] = 5.0
    with pytest.raises(pg.PrecompileError, match="FACTOR"):
        loaded(model, x)
    vars(library)["FACTOR"] = 2.0
    torch.testing.assert_close(loaded(model, x), step(model, x))


def _leaky(alpha: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def act(x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, alpha)

    return act


class WithActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = _leaky(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


def test_a_closure_cell_held_by_the_model_is_checked() -> None:
    model, x = WithActivation(), example()
    code, cache = pg.precompile(lambda m, x: m(x), model, x, backend="eager")
    values = pg.parse_metadata(code)["PYTHON_VALUES"]
    assert ("argument 0: .act.__closure__[0].cell_contents", "0.2") in values
    loaded = pg.load(code, cache)
    torch.testing.assert_close(loaded(model, x), model(x))
    model.act = _leaky(0.5)
    with pytest.raises(
        pg.PrecompileError,
        match=r"\(`m\.act\.__closure__\[0\]\.cell_contents`\) is 0\.5",
    ):
        loaded(model, x)


def test_the_functions_own_closure_is_recorded_and_named_at_capture(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scale = 3.0

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x) * scale

    with caplog.at_level(logging.WARNING):
        cap = pg.capture(step, nn.Linear(4, 4), example(), backend="eager")
    assert ("closure variable scale of step", "3.0") in cap.convention.python_values
    assert "closure variable scale of step" in caplog.text
    assert "Pass them as arguments" in caplog.text


def test_inspect_shows_the_values(tmp_path: object) -> None:
    from precompile_gen.tools.inspection import inspect_artifact
    from precompile_gen.tools.report_text import format_report

    code, _ = pg.precompile(scaled, Scaled(), example(), backend="eager")
    report = format_report(inspect_artifact(code))
    assert "Python values built into the graph" in report
    assert "argument 0: .temperature" in report


# --- Effects refused at capture -----------------------------------------------------
class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


class Logging(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(tuple(x.shape))
        return self.lin(x)


def count_calls(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    global COUNT
    COUNT += 1
    return model(x)


def record_history(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    HISTORY.append(1)
    return model(x)


def _line_of(text: str) -> str:
    with open(__file__, encoding="utf-8") as file:
        source = file.read().splitlines()
    return f"{__file__}:{source.index(text) + 1}"


@pytest.mark.parametrize(
    ("fn", "model", "target", "line"),
    [
        (scaled, Counting(), "argument 0 (`model.calls`)", "        self.calls += 1"),
        (
            scaled,
            Logging(),
            "argument 0 (`model.seen`)",
            "        self.seen.append(tuple(x.shape))",
        ),
        (count_calls, nn.Linear(4, 4), "global COUNT", "    COUNT += 1"),
        (record_history, nn.Linear(4, 4), "global HISTORY", "    HISTORY.append(1)"),
    ],
)
def test_a_write_to_python_state_is_refused_naming_the_line(
    fn: Callable[..., object], model: nn.Module, target: str, line: str
) -> None:
    x = example()
    before = (dict(vars(model)), COUNT, list(HISTORY))
    snapshot = StateSnapshot(model, x)
    with pytest.raises(pg.PrecompileError) as error:
        pg.capture(fn, model, x, backend="eager")
    message = str(error.value)
    assert target in message and _line_of(line) in message
    assert "register_buffer" in message and "Move the write out" in message
    assert (dict(vars(model)), COUNT, list(HISTORY)) == before
    snapshot.assert_unchanged()


def mixup(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    lam = np.random.beta(0.2, 0.2)
    return model(x * lam + x.flip(0) * (1 - lam))


def jitter(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x + random.gauss(0.0, 0.1))


@pytest.mark.parametrize(
    ("fn", "generator", "line"),
    [
        (mixup, "numpy.random.beta", "    lam = np.random.beta(0.2, 0.2)"),
        (jitter, "random.gauss", "    return model(x + random.gauss(0.0, 0.1))"),
    ],
)
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_python_or_numpy_random_draw_is_refused(
    fn: Callable[..., object], generator: str, line: str, backend: str
) -> None:
    python_state = random.getstate()
    numpy_state = cast(tuple[Any, ...], np.random.get_state())[1].copy()
    with pytest.raises(pg.PrecompileError) as error:
        pg.capture(fn, nn.Linear(4, 4), example(), backend=backend)
    message = str(error.value)
    assert generator in message and _line_of(line) in message
    assert "torch.distributions" in message and "pass the value in" in message
    assert random.getstate() == python_state
    assert (cast(tuple[Any, ...], np.random.get_state())[1] == numpy_state).all()


def test_an_optimizers_own_state_is_not_an_effect() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> object:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    cap = pg.capture(step, model, opt, example(), backend="eager")
    assert cap.convention.optimizers


def test_each_capture_of_one_function_records_its_values() -> None:
    # The backward breaks Dynamo's graph inside the step, so the step's own frame is
    # compiled: a second capture must not reuse what the first one compiled.
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach() * SCALE

    for _ in range(3):
        model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0))
        cap = pg.capture(step, model, example(), backend="eager")
        assert ("argument 0: .1.p", "0.0") in cap.convention.python_values
        assert (
            f"global SCALE (module {__name__})",
            "1.0",
        ) in cap.convention.python_values


def test_a_transformers_model_records_what_its_forward_reads() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))

    def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    code, cache = pg.precompile(logits, model, ids, backend="eager")
    values = dict(pg.parse_metadata(code)["PYTHON_VALUES"])
    assert values["argument 0: .transformer.ln_f.eps"] == "1e-05"
    # The library's own module globals are its configuration, not the program's.
    assert not any(path.startswith("global ") for path in values)
    loaded = pg.load(code, cache)
    torch.testing.assert_close(loaded(model, ids), logits(model, ids))
    model.transformer.ln_f.eps = 1e-3
    with pytest.raises(
        pg.PrecompileError,
        match=r"argument 0 \(`model\.transformer\.ln_f\.eps`\) is 0\.001",
    ):
        loaded(model, ids)


class Activated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.activation = "relu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return F.relu(y) if self.activation == "relu" else F.gelu(y)


def test_a_string_value_is_checked() -> None:
    model, x = Activated(), example()
    code, cache = pg.precompile(lambda m, x: m(x), model, x, backend="eager")
    loaded = pg.load(code, cache)
    torch.testing.assert_close(loaded(model, x), model(x))
    model.activation = "gelu"
    with pytest.raises(
        pg.PrecompileError, match="is 'gelu' in this call, but it was 'relu'"
    ):
        loaded(model, x)
    model.activation = "relu"
    torch.testing.assert_close(loaded(model, x), model(x))


def test_a_value_gone_from_the_model_is_rejected(loaded: Callable[..., object]) -> None:
    model, x = Scaled(), example()
    loaded(model, x)
    del model.temperature
    with pytest.raises(pg.PrecompileError) as error:
        loaded(model, x)
    assert "at argument 0 (`model.temperature`) is missing in this call" in str(
        error.value
    )
    assert "Set it back to 1.0" in str(error.value)


_draw = random.random  # bound before capture: no refusal at the call, only after it


def jitter_with_an_alias(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x) * _draw()


def test_a_draw_through_an_alias_is_refused_and_the_state_kept() -> None:
    python_state = random.getstate()
    with pytest.raises(pg.PrecompileError) as error:
        pg.capture(jitter_with_an_alias, nn.Linear(4, 4), example(), backend="eager")
    assert "draws from Python's random module or NumPy's global generator" in str(
        error.value
    )
    assert "pass the value in" in str(error.value)
    assert random.getstate() == python_state


def draw_with(model: nn.Module, x: torch.Tensor, generator: torch.Generator):
    return model(x) * torch.rand(x.shape, generator=generator)


@pytest.mark.parametrize(
    ("fn", "extra"),
    [
        (count_calls, ()),
        (jitter, ()),
        (jitter_with_an_alias, ()),
        (draw_with, (torch.Generator().manual_seed(1),)),
    ],
    ids=["effect", "draw", "draw through an alias", "own generator"],
)
def test_a_refusal_is_the_public_error_type_with_a_clean_message(
    fn: Callable[..., object], extra: tuple[object, ...]
) -> None:
    # A traceback prints the raised type's name: the one users catch, not an
    # internal subclass of it.
    with pytest.raises(pg.PrecompileError) as error:
        pg.capture(fn, nn.Linear(4, 4), example(), *extra, backend="eager")
    assert type(error.value) is pg.PrecompileError
    assert type(error.value).__name__ == "PrecompileError"
    message = str(error.value)
    assert message == message.strip() and "\n" not in message, repr(message)
    assert "Move the write out" in message or "pass" in message, message


class Locked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lock = threading.Lock()  # cannot be deep-copied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_arguments_that_cannot_be_copied_are_named_in_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, x = Locked(), example()
    with caplog.at_level(logging.WARNING):
        code, cache = pg.precompile(lambda m, x: m(x), model, x, backend="eager")
    assert "could not be recorded" in caplog.text and "deep-copied" in caplog.text
    torch.testing.assert_close(pg.load(code, cache)(model, x), model(x))


def classify(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach()


def test_a_library_write_to_a_value_read_does_not_outlive_the_capture() -> None:
    # transformers' classifier sets config.problem_type on its first call with
    # labels, after reading it (None): the trace makes that write on the model.
    from helpers import model_zoo

    torch.manual_seed(0)
    model = model_zoo.bert().eval()
    twin = copy.deepcopy(model)
    ids, labels = torch.randint(0, 100, (2, 8)), torch.tensor([0, 2])
    code, cache = pg.precompile(classify, model, ids, labels, backend="eager")
    assert cast(Any, model).config.problem_type is None
    step = pg.load(code, cache)
    for call in range(3):
        ids, labels = torch.randint(0, 100, (2, 8)), torch.tensor([call % 3, 1])
        torch.testing.assert_close(
            step(model, ids, labels), classify(twin, ids, labels)
        )
        for (name, param), theirs in zip(
            model.named_parameters(), twin.parameters(), strict=True
        ):
            torch.testing.assert_close(param.grad, theirs.grad, msg=name)


def adamw_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = model(x).square().mean() * SCALE
    loss.backward()
    opt.step()
    return loss.detach()


def test_an_optimizer_stepping_without_dynamo_records_the_same_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch.optim's own step runs without Dynamo in the pass, which saves the
    # seconds of tracing it: what it reads is the optimizer checks' business.
    from precompile_gen.capturing import python_state

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Dropout(0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    arguments = (model, opt, example())
    stepping_eagerly = python_state.observe(adamw_step, arguments)
    monkeypatch.setattr(python_state, "_steps_unobserved", lambda copies: None)
    assert stepping_eagerly == python_state.observe(adamw_step, arguments)
    assert (f"global SCALE (module {__name__})", "1.0") in stepping_eagerly
