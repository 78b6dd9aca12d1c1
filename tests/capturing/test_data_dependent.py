"""Data-dependent code: what a function reads from tensor values.

The common cases run on both backends as eager runs them: a training step that returns
``loss.item()`` (or computes with it, ``loss / loss.item()``), BatchNorm with
``momentum=None`` (a cumulative average that reads
``num_batches_tracked``), sampling from ``torch.distributions`` with argument
validation on, ``F.one_hot`` with its number of classes (a mixture-of-experts router,
soft targets; its range checked at every call), and ``torch.cond`` with inputs that
take either branch. Every other
value read is refused at capture, naming the line of the function that read it and
the fixes. Each artifact is compiled once per backend in a module-scoped fixture.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import pytest
import torch
from helpers.source_lines import line_of
from helpers.state_snapshot import (
    StateSnapshot,
    assert_call_rejected,
    assert_same_state,
)
from torch import nn
from torch.nn import functional as F

import precompile_gen as pg

BACKENDS = ["eager", "inductor"]


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make_regressor(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def artifact(fn: Callable[..., object], *args: object, backend: str) -> Callable:
    code, cache = pg.precompile(fn, *args, backend=backend)
    return pg.load(code, cache)


# --- loss.item() ----------------------------------------------------------------------


def item_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.item()


def logged_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    out = model(x)
    loss = F.mse_loss(out, y)
    loss.backward()
    return {"loss": loss.item(), "out": out.detach(), "max": out.max().item()}


@pytest.fixture(scope="module", params=BACKENDS)
def item_artifacts(request: pytest.FixtureRequest) -> tuple[str, Callable, Callable]:
    model, x, y = make_regressor(0), randn(6, 4, seed=1), randn(6, 1, seed=2)
    return (
        request.param,
        artifact(item_step, model, x, y, backend=request.param),
        artifact(logged_step, model, x, y, backend=request.param),
    )


def test_returned_item_is_eager_python_number(
    item_artifacts: tuple[str, Callable, Callable],
) -> None:
    _, step, _ = item_artifacts
    eager_model, model = make_regressor(0), make_regressor(0)
    for seed in (3, 5, 7):
        x, y = randn(6, 4, seed=seed), randn(6, 1, seed=seed + 1)
        expected = item_step(eager_model, x, y)
        result = step(model, x, y)
        assert type(result) is float
        assert result == pytest.approx(expected, rel=1e-6)
    assert_same_state(model, eager_model)


def test_item_inside_a_returned_dict(
    item_artifacts: tuple[str, Callable, Callable],
) -> None:
    _, _, step = item_artifacts
    eager_model, model = make_regressor(0), make_regressor(0)
    x, y = randn(6, 4, seed=11), randn(6, 1, seed=12)
    expected = logged_step(eager_model, x, y)
    result = step(model, x, y)
    assert type(result["loss"]) is float and type(result["max"]) is float
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert result["max"] == pytest.approx(expected["max"], rel=1e-6)
    torch.testing.assert_close(result["out"], expected["out"])
    assert_same_state(model, eager_model)


def test_item_metadata_names_the_scalar_outputs() -> None:
    model, x, y = make_regressor(0), randn(6, 4, seed=1), randn(6, 1, seed=2)
    code, _ = pg.precompile(logged_step, model, x, y, backend="eager")
    # Flat outputs in the dict's order: loss, out, max.
    assert pg.parse_metadata(code)["SCALAR_OUTPUTS"] == [0, 2]


# --- BatchNorm(momentum=None) -----------------------------------------------------


def make_bn1d(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=None), nn.ReLU(), nn.Linear(6, 1)
    ).train()


def make_bn2d(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3, momentum=None),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(48, 1),
    ).train()


def batches_tracked(model: nn.Module) -> int:
    return int(model.get_buffer("1.num_batches_tracked"))


def bn_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


@pytest.fixture(scope="module", params=BACKENDS)
def bn_artifacts(request: pytest.FixtureRequest) -> dict[str, Callable]:
    backend = request.param
    eval_model = make_bn2d(0).eval()
    return {
        "step": artifact(
            bn_step,
            make_bn1d(0),
            randn(5, 4, seed=1),
            randn(5, 1, seed=2),
            backend=backend,
        ),
        "train_forward": artifact(
            predict, make_bn2d(0), randn(4, 2, 4, 4, seed=3), backend=backend
        ),
        "eval_forward": artifact(
            predict, eval_model, randn(4, 2, 4, 4, seed=3), backend=backend
        ),
    }


def test_cumulative_batch_norm_training_step(bn_artifacts: dict[str, Callable]) -> None:
    eager_model, model = make_bn1d(0), make_bn1d(0)
    for call in range(3):
        x, y = randn(5, 4, seed=10 + call), randn(5, 1, seed=20 + call)
        torch.testing.assert_close(
            bn_artifacts["step"](model, x, y), bn_step(eager_model, x, y)
        )
    assert_same_state(model, eager_model)
    assert batches_tracked(model) == 3


def test_cumulative_batch_norm_forward(bn_artifacts: dict[str, Callable]) -> None:
    for name, mode in (("train_forward", True), ("eval_forward", False)):
        eager_model, model = make_bn2d(0).train(mode), make_bn2d(0).train(mode)
        for call in range(3):
            x = randn(4, 2, 4, 4, seed=30 + call)
            torch.testing.assert_close(bn_artifacts[name](model, x), eager_model(x))
        assert_same_state(model, eager_model)
        assert batches_tracked(model) == (3 if mode else 0)


# --- a float from .item() in arithmetic ----------------------------------------------


def normalised_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss = loss / loss.detach().item()
    loss.backward()
    opt.step()
    return loss.detach()


def rescaled_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    scale = 1.0 / (loss.item() + 1e-3)
    (loss * scale * 2).backward()
    opt.step()
    return scale - 0.5


@pytest.fixture(scope="module", params=BACKENDS)
def arithmetic_artifacts(request: pytest.FixtureRequest) -> dict[str, Callable]:
    artifacts = {}
    for fn in (normalised_step, rescaled_step):
        model = make_regressor(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        example = (randn(6, 4, seed=1), randn(6, 1, seed=2))
        artifacts[fn.__name__] = artifact(
            fn, model, opt, *example, backend=request.param
        )
    return artifacts


@pytest.mark.parametrize("fn", [normalised_step, rescaled_step])
def test_a_float_from_item_flows_into_the_step_as_eager_computes_it(
    arithmetic_artifacts: dict[str, Callable], fn: Callable[..., object]
) -> None:
    # The number changes at every call: the graph computes it, and the returned
    # one is a Python float again.
    model, twin = make_regressor(0), make_regressor(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for call in range(3):
        x, y = randn(6, 4, seed=110 + call), randn(6, 1, seed=120 + call) * (call + 1)
        got = arithmetic_artifacts[fn.__name__](model, opt, x, y)
        expected = fn(twin, twin_opt, x, y)
        assert type(got) is type(expected)
        if isinstance(expected, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype
        torch.testing.assert_close(got, expected)
        assert_same_state(model, twin)


def mixed_with_item(
    model: nn.Module, x: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    s = model(x).sum().item()
    return h * s, (h.to(torch.int64) + 3) / s, h.double() - s, (s * 3 - 1) / h.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_float_from_item_promotes_and_rounds_as_a_python_float(
    dtype: torch.dtype,
) -> None:
    # Bit for bit on the eager backend: the dtypes ATen promotes to, the float32 it
    # computes half precision in, and number / tensor as reciprocal() * number.
    model, h = make_regressor(0), (randn(5, seed=3) * 7).to(dtype)
    forward = artifact(mixed_with_item, model, randn(3, 4, seed=1), h, backend="eager")
    for call in range(3):
        x, h = randn(3, 4, seed=130 + call), (randn(5, seed=140 + call) * 7).to(dtype)
        got, expected = forward(model, x, h), mixed_with_item(model, x, h)
        assert isinstance(got, tuple)
        for a, b in zip(got, expected, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


def inverse_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return 1.0 / F.mse_loss(model(x), y).item()


def test_dividing_by_an_item_of_zero_raises_where_eager_does() -> None:
    model, x = make_regressor(0), randn(6, 4, seed=1)
    forward = artifact(inverse_loss, model, x, randn(6, 1, seed=2), backend="eager")
    y = model(x).detach()
    with pytest.raises(ZeroDivisionError):
        inverse_loss(model, x, y)
    with pytest.raises(RuntimeError, match="divides by zero, where eager raises"):
        forward(model, x, y)


# --- torch.istft ----------------------------------------------------------------------


class MaskEstimator(nn.Module):
    """Speech enhancement: a mask for each bin of the noisy spectrogram."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(9, 16), nn.ReLU(), nn.Linear(16, 9))

    def forward(self, magnitude: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net(magnitude.transpose(1, 2))).transpose(1, 2)


def enhance_step(
    model: nn.Module, noisy: torch.Tensor, clean: torch.Tensor
) -> torch.Tensor:
    window = torch.hann_window(16)
    spec = torch.stft(noisy, 16, hop_length=4, window=window, return_complex=True)
    masked = spec * model(spec.abs())
    # istft checks that its window's envelope is nonzero: a value read, from a
    # window fn creates, which is the same at every call.
    out = torch.istft(masked, 16, hop_length=4, window=window, length=noisy.shape[-1])
    loss = F.mse_loss(out, clean)
    loss.backward()
    return loss.detach()


def test_istft_after_a_mask_matches_eager() -> None:
    model, eager_model = MaskEstimator(), MaskEstimator()
    forward = artifact(
        enhance_step, model, randn(2, 64, seed=0), randn(2, 64, seed=1), backend="eager"
    )
    for seed in range(2, 5):
        noisy, clean = randn(2, 64, seed=seed), randn(2, 64, seed=seed + 10)
        got = forward(model, noisy, clean)
        assert torch.equal(got, enhance_step(eager_model, noisy, clean))
    assert_same_state(model, eager_model, rtol=0, atol=0)


# --- torch.distributions -------------------------------------------------------------


def mixup_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    lam = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4)).sample()
    index = torch.randperm(x.shape[0])
    out = model(lam * x + (1 - lam) * x[index])
    loss = lam * F.mse_loss(out, y) + (1 - lam) * F.mse_loss(out, y[index])
    loss.backward()
    return loss


def reparametrized_step(
    model: nn.Module, x: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    loc = model(x)
    z = torch.distributions.Normal(loc, scale).rsample()
    loss = z.pow(2).mean()
    loss.backward()
    return z, loss


@pytest.fixture(scope="module", params=BACKENDS)
def sampling_artifacts(request: pytest.FixtureRequest) -> dict[str, Callable]:
    backend = request.param
    model, x, y = make_regressor(0), randn(6, 4, seed=1), randn(6, 1, seed=2)
    return {
        "mixup": artifact(mixup_step, model, x, y, backend=backend),
        "normal": artifact(
            reparametrized_step, model, x, torch.full((6, 1), 0.5), backend=backend
        ),
    }


def test_beta_mixup_matches_eager_under_a_seed(
    sampling_artifacts: dict[str, Callable],
) -> None:
    assert torch.distributions.Distribution._validate_args
    eager_model, model = make_regressor(0), make_regressor(0)
    for call in range(3):
        x, y = randn(6, 4, seed=40 + call), randn(6, 1, seed=50 + call)
        torch.manual_seed(call)
        expected = mixup_step(eager_model, x, y)
        torch.manual_seed(call)
        torch.testing.assert_close(sampling_artifacts["mixup"](model, x, y), expected)
    assert_same_state(model, eager_model)


def test_normal_rsample_matches_eager_under_a_seed(
    sampling_artifacts: dict[str, Callable],
) -> None:
    eager_model, model = make_regressor(0), make_regressor(0)
    for call in range(2):
        x, scale = randn(6, 4, seed=60 + call), torch.full((6, 1), 0.3 + call)
        torch.manual_seed(call)
        expected = reparametrized_step(eager_model, x, scale)
        torch.manual_seed(call)
        result = sampling_artifacts["normal"](model, x, scale)
        torch.testing.assert_close(result, expected)
    assert_same_state(model, eager_model)


def test_distribution_argument_check_still_raises(
    sampling_artifacts: dict[str, Callable],
) -> None:
    # Eager refuses a negative scale with ValueError; the artifact's graph checks the
    # same constraint at every call.
    x, scale = randn(6, 4, seed=70), torch.full((6, 1), -1.0)
    with pytest.raises(ValueError, match="scale"):
        reparametrized_step(make_regressor(0), x, scale)
    model = make_regressor(0)
    snapshot = StateSnapshot(model, x, scale)
    with pytest.raises(RuntimeError, match=r"torch\.distributions argument check"):
        sampling_artifacts["normal"](model, x, scale)
    snapshot.assert_unchanged()


# --- torch.cond ----------------------------------------------------------------------


def make_projection(seed: int) -> nn.Linear:
    # No bias: negating the input negates the output, so a call takes the other branch.
    torch.manual_seed(seed)
    return nn.Linear(4, 3, bias=False)


def cond_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    y = torch.cond(
        out.sum() > 0, lambda o: o.sin(), lambda o: o.cos() * 2 - model(x), (out,)
    )
    y.pow(2).mean().backward()
    return y


def cond_predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.cond(x.mean() > 0, model, lambda v: model(v).relu(), (x,))


def scaled_down(v: torch.Tensor) -> torch.Tensor:
    return torch.cond(v.sum() < -1, lambda u: u * 3, lambda u: u - 1, (v,))


def nested_cond(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.cond(
        x.mean() > 0, lambda v: scaled_down(model(v)), lambda v: model(v).relu(), (x,)
    )


@pytest.fixture(scope="module", params=BACKENDS)
def cond_artifacts(request: pytest.FixtureRequest) -> dict[str, Callable]:
    backend = request.param
    model, x = make_projection(0), randn(5, 4, seed=1).abs()
    return {
        "step": artifact(cond_step, model, x, backend=backend),
        "predict": artifact(cond_predict, model, x, backend=backend),
        "nested": artifact(nested_cond, model, x, backend=backend),
    }


@pytest.mark.parametrize("signs", [(1, -1, 1), (-1, 1)])
def test_cond_takes_the_branch_of_each_call(
    cond_artifacts: dict[str, Callable], signs: tuple[int, ...]
) -> None:
    eager_model, model = make_projection(0), make_projection(0)
    for call, sign in enumerate(signs):
        x = randn(5, 4, seed=80 + call).abs() * sign
        torch.testing.assert_close(
            cond_artifacts["step"](model, x), cond_step(eager_model, x)
        )
        torch.testing.assert_close(
            cond_artifacts["predict"](model, x), cond_predict(eager_model, x)
        )
    assert_same_state(model, eager_model)


def test_nested_cond_takes_the_branches_of_each_call(
    cond_artifacts: dict[str, Callable],
) -> None:
    model = make_projection(0)
    # The outer false branch, then the inner false and true ones (the projection
    # of this positive input sums to -0.64 per unit of scale).
    for scale in (-1.0, 0.01, 10.0):
        x = randn(5, 4, seed=90).abs() * scale
        torch.testing.assert_close(
            cond_artifacts["nested"](model, x), nested_cond(model, x)
        )


def test_eager_artifact_carries_the_branches() -> None:
    code, _ = pg.precompile(
        cond_predict, make_projection(0), randn(5, 4, seed=1), backend="eager"
    )
    assert "def _graph_true_graph_0(self" in code
    assert "true_graph_0 = _graph_true_graph_0" in code


# --- refused reads -------------------------------------------------------------------


FIXES = ["torch.where", "torch.cond", "out of the function"]


def assert_refused(
    fn: Callable[..., object], *args: object, match: Iterable[str]
) -> str:
    """Capturing ``fn(*args)`` is refused naming ``match`` and the fixes, in
    precompile_gen's words (not make_fx's), and changes nothing."""
    capture = functools.partial(pg.precompile, fn, backend="eager")
    message = assert_call_rejected(capture, *args, match=[*match, *FIXES])
    assert "tracing_mode" not in message
    return message


def scaled_by_value(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out * float(out.abs().max())


def repeated_by_value(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.repeat(int(out.argmax()) + 1, 1)


def values_as_list(model: nn.Module, x: torch.Tensor) -> list:
    return model(x).tolist()


def computes_with_item(model: nn.Module, x: torch.Tensor) -> float:
    total = model(x).sum().item()
    return round(total * 2, 3)


def counts_with_item(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # An int's arithmetic (Python's ints do not overflow; the graph's would).
    positive = (model(x) > 0).sum().item()
    return model(x) * (positive + 1)


def tensor_of_item(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    total = model(x).sum().item()
    return model(x) * torch.tensor([total])


def formats_item(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    print(f"{out.mean().item():.3f}")
    return out


@pytest.mark.parametrize(
    ("fn", "text", "what"),
    [
        (scaled_by_value, "float(out", "Python value"),
        (repeated_by_value, "int(out", "Python value"),
        (values_as_list, ".tolist()", ".tolist()"),
        (computes_with_item, "return round(total * 2, 3)", ".item()"),
        (counts_with_item, "return model(x) * (positive + 1)", ".item()"),
        (formats_item, "print(", ".item()"),
        (tensor_of_item, "torch.tensor([total])", "passed to torch.tensor"),
    ],
)
def test_value_read_names_the_line_and_the_fixes(
    fn: Callable[..., object], text: str, what: str
) -> None:
    model = make_regressor(0)
    model(randn(2, 4, seed=0)).sum().backward()  # a .grad to keep untouched
    message = assert_refused(
        fn, model, randn(6, 4, seed=1), match=[line_of(fn, text), what, fn.__name__]
    )
    if fn in (computes_with_item, tensor_of_item):
        assert line_of(fn, "total = ") in message


def one_hot_labels(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Without num_classes, one_hot reads it off the values (their maximum).
    labels = model(x).argmax(-1)
    return F.one_hot(labels)


def resynthesised(model: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # A learnt window: istft's check of its envelope reads the weights' values.
    # (A torch.hann_window, the same at every call, is read: test_istft_after_...)
    window = model.weight[0, :8].sigmoid()
    spectrum = torch.stft(model(x), 8, window=window, return_complex=True)
    return torch.istft(spectrum * 0.5, 8, window=window)


@pytest.mark.parametrize(
    ("fn", "features", "text", "op", "advice"),
    [
        (one_hot_labels, 4, "F.one_hot(", "torch.nn.functional.one_hot", "num_classes"),
        (resynthesised, 16, "torch.istft(", "torch.istft", "outside the precompiled"),
    ],
)
def test_an_op_that_reads_a_value_is_named_rather_than_the_users_line(
    fn: Callable[..., object], features: int, text: str, op: str, advice: str
) -> None:
    # The value is read inside the op (one_hot's range check, istft's window
    # check): torch.where or torch.cond in the user's code would not help.
    model, x = (
        nn.Linear(features, 16 if fn is resynthesised else 3),
        randn(2, features, seed=1),
    )
    snapshot = StateSnapshot(model, x)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(fn, model, x, backend="eager")
    message = str(caught.value)
    for expected in (f"calls {op} at {line_of(fn, text)}", "reads a value", advice):
        assert expected in message, f"{expected!r} not in the message: {message}"
    assert "torch.cond" not in message
    snapshot.assert_unchanged()


# --- F.one_hot with its number of classes ---------------------------------------------


class Router(nn.Module):
    """A mixture-of-experts layer: top-2 gating, one_hot masks counting each
    expert's load (for a balancing loss), and each token's two expert outputs
    combined with index_add."""

    def __init__(self, width: int = 4, experts: int = 3) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        weights, chosen = probs.topk(2, dim=-1)
        mask = F.one_hot(chosen, len(self.experts)).float()  # tokens x 2 x experts
        balance = (mask.sum((0, 1)) * probs.mean(0)).sum()
        outputs = torch.stack([expert(x) for expert in self.experts])
        token = torch.arange(x.shape[0]).repeat_interleave(2)
        picked = outputs[chosen.flatten(), token] * weights.flatten().unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, picked) + 0.01 * balance


def routed_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def soft_target_step(
    model: nn.Module, x: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    target = F.one_hot(labels, 3).float() * 0.9 + 0.1 / 3
    loss = -(model(x).log_softmax(-1) * target).sum(-1).mean()
    loss.backward()
    return loss.detach()


def make_router() -> Router:
    torch.manual_seed(0)
    return Router()


def make_classifier() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


@pytest.fixture(scope="module", params=BACKENDS)
def one_hot_artifacts(request: pytest.FixtureRequest) -> dict[str, Callable]:
    router = make_router()
    opt = torch.optim.SGD(router.parameters(), lr=0.1)
    labels = torch.tensor([0, 2, 1, 1, 0, 2])
    return {
        "router": artifact(
            routed_step, router, opt, randn(6, 4, seed=1), backend=request.param
        ),
        "soft": artifact(
            soft_target_step,
            make_classifier(),
            randn(6, 4, seed=2),
            labels,
            backend=request.param,
        ),
    }


def test_a_mixture_of_experts_routed_by_one_hot_matches_eager(
    one_hot_artifacts: dict[str, Callable],
) -> None:
    # Each call routes its tokens to other experts.
    model, twin = make_router(), make_router()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for call in range(3):
        x = randn(6, 4, seed=80 + call)
        got = one_hot_artifacts["router"](model, opt, x)
        torch.testing.assert_close(got, routed_step(twin, twin_opt, x))
        assert_same_state(model, twin)


def test_one_hot_of_labels_matches_eager_and_refuses_a_class_out_of_range(
    one_hot_artifacts: dict[str, Callable],
) -> None:
    model, twin = make_classifier(), make_classifier()
    for call in range(2):
        x, labels = randn(6, 4, seed=90 + call), torch.tensor([2, 2, 0, 1, call, 0])
        got = one_hot_artifacts["soft"](model, x, labels)
        torch.testing.assert_close(got, soft_target_step(twin, x, labels))
        assert_same_state(model, twin)
    x, labels = randn(6, 4, seed=99), torch.tensor([0, 1, 3, 0, 1, 2])
    with pytest.raises(RuntimeError, match="Class values must be"):
        soft_target_step(make_classifier(), x, labels)
    snapshot = StateSnapshot(model, x, labels)
    with pytest.raises(RuntimeError, match=r"F\.one_hot at .* outside \[0, 3\)"):
        one_hot_artifacts["soft"](model, x, labels)
    snapshot.assert_unchanged()


class SignGate(torch.autograd.Function):
    """A custom function whose forward branches on a value in the user's code."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x.clone()
        return -x

    @staticmethod
    def backward(ctx: object, *grads: torch.Tensor) -> torch.Tensor:
        return grads[0]


def gated(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return SignGate.apply(model(x))


def test_a_branch_in_user_code_an_op_calls_back_is_traced_both_ways() -> None:
    # Function.apply runs the user's forward: the branch is the user's, and the
    # artifact holds both of its sides (test_value_branches.py has the rest).
    model = make_regressor(0)
    run = artifact(gated, model, randn(6, 4, seed=1), backend="eager")
    for scale in (1.0, -1.0, 100.0, -100.0):
        x = randn(6, 4, seed=2) * scale
        assert torch.equal(run(model, x), gated(model, x))


def test_values_independent_of_the_inputs_are_read() -> None:
    def scaled(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        sizes = torch.arange(3).tolist()
        return model(x) * len(sizes) * torch.arange(4).sum().item()

    model, x = make_regressor(0), randn(6, 4, seed=1)
    torch.testing.assert_close(
        artifact(scaled, model, x, backend="eager")(model, x), scaled(model, x)
    )


def test_user_batch_norm_subclass_is_refused_where_it_reads() -> None:
    class GatedBatchNorm(nn.BatchNorm1d):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            largest = float(self.weight.detach().abs().max())
            return super().forward(input) * (largest > 0)

    model = nn.Sequential(nn.Linear(4, 6), GatedBatchNorm(6, momentum=None))
    assert_refused(
        predict,
        model,
        randn(5, 4, seed=1),
        match=[line_of(GatedBatchNorm.forward, "largest =")],
    )


def test_while_loop_is_refused() -> None:
    def repeated(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        _, y = torch.while_loop(
            lambda i, v: i < 3, lambda i, v: (i + 1, v * 2), (torch.tensor(0), x)
        )
        return model(y)

    model, x = make_regressor(0), randn(6, 4, seed=1)
    snapshot = StateSnapshot(model, x)
    with pytest.raises(pg.PrecompileError, match=r"while_loop.*only torch\.cond"):
        pg.precompile(repeated, model, x, backend="eager")
    snapshot.assert_unchanged()


def test_tensor_created_inside_a_cond_branch_is_refused() -> None:
    def offset(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(
            x.sum() > 0,
            lambda v: model(v) + torch.tensor([1.0, 2.0, 3.0]),
            lambda v: model(v),
            (x,),
        )

    model, x = make_projection(0), randn(5, 4, seed=1)
    snapshot = StateSnapshot(model, x)
    with pytest.raises(pg.PrecompileError, match=r"torch\.cond branch.*operands"):
        pg.precompile(offset, model, x, backend="eager")
    snapshot.assert_unchanged()


def test_batch_norm_forward_is_restored_after_capture() -> None:
    # The trace swaps BatchNorm's forward only while it runs.
    model = make_bn1d(0)
    x, y = randn(5, 4, seed=1), randn(5, 1, seed=2)
    pg.capture(bn_step, model, x, y, backend="eager")
    assert "forward" not in vars(model[1])
