"""Sizes that values decide: torch.nonzero, masked_select, boolean-mask indexing,
torch.where(mask).

The graph runs such an op at every call, so each call gets its own size. What the
trace cannot keep is such a size as a Python int: read by the program
(``x[:len(idx)]``), which would silently keep the example's number, or taken by an op
autograd records for the sizes it saw (the backward of a mixture-of-experts
dispatch), which would fail at calls with other values. Both are refused at capture,
naming the line or the op and the fix; a static dim of such a tensor is read as usual.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers.source_lines import line_of
from helpers.state_snapshot import StateSnapshot
from torch import nn
from torch.nn import functional as F

import precompile_gen as pg

BACKENDS = ["eager", "inductor"]


def make_linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 4)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- Reads of such a size as a Python int ---------------------------------------------


def first_rows(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    idx = torch.nonzero(out[:, 0] > 0).squeeze(1)
    return x[: idx.shape[0]].sum(0)


def counted(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    chosen = out[out[:, 0] > 0]
    return x[: len(chosen)].sum(0)


def zeros_like_count(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    chosen = torch.masked_select(out, out > 0)
    return torch.zeros(chosen.size(0), 2) + out.sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("fn", "line"),
    [
        (first_rows, "return x[: idx.shape[0]]"),
        (counted, "return x[: len(chosen)]"),
        (zeros_like_count, "torch.zeros(chosen.size(0), 2)"),
    ],
)
def test_a_size_the_values_decide_read_as_an_int_is_refused(
    fn: Callable[..., torch.Tensor], line: str, backend: str
) -> None:
    # Captured, the first would silently sum the example's count of rows.
    model, x = make_linear(0), randn(6, 4, seed=1)
    snapshot = StateSnapshot(model, x)
    with pytest.raises(pg.PrecompileError) as info:
        pg.precompile(fn, model, x, backend=backend)
    message = str(info.value)
    assert f"reads, at {line_of(fn, line)}" in message
    assert "a size that the values of its inputs decide" in message
    assert "Compute with the tensor itself rather than its size" in message
    snapshot.assert_unchanged()


def normalised_positives(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    chosen = out[out[:, 0] > 0]
    # Its last dim is the model's width, whatever the values.
    return F.layer_norm(chosen, chosen.shape[-1:]).sum(0) * chosen.size(-1)


def selections(
    model: nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = model(x)
    return torch.nonzero(out > 0), torch.masked_select(out, out > 0) * 2, out[out < 0]


@pytest.mark.parametrize("fn", [normalised_positives, selections])
def test_each_call_gets_its_own_sizes(fn: Callable[..., object]) -> None:
    model = make_linear(0)
    code, cache = pg.precompile(fn, model, randn(6, 4, seed=1), backend="eager")
    forward = pg.load(code, cache)
    sizes = set()
    for seed in range(2, 7):
        x = randn(6, 4, seed=seed)
        got, want = forward(model, x), fn(model, x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        sizes.add(str([t.shape for t in want] if isinstance(want, tuple) else 0))
    if fn is selections:
        assert len(sizes) > 1, "the calls all had the example's sizes"


# --- A backward that takes such a size ------------------------------------------------


class SparseMoE(nn.Module):
    """Top-2 routing as Mixtral's block writes it: each expert runs on the tokens
    routed to it, found with torch.where, and adds its output with index_add_."""

    def __init__(self, width: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = F.softmax(self.gate(x), dim=-1)
        weights, chosen = torch.topk(weights, 2, dim=-1)
        mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            routed = expert(x[token]) * weights[token, slot, None]
            out.index_add_(0, token, routed)
        return out


def moe_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def test_a_backward_built_for_the_example_s_routing_is_refused() -> None:
    # Captured, a call routing another number of tokens to an expert would fail
    # deep inside the backward (an expand to the example's count).
    torch.manual_seed(0)
    model = SparseMoE()
    snapshot = StateSnapshot(model)
    with pytest.raises(pg.PrecompileError) as info:
        pg.precompile(moe_step, model, randn(10, 8, seed=1), backend="eager")
    message = str(info.value)
    assert "'moe_step' calls aten.nonzero.default" in message
    assert "the trace's aten.expand.default takes that size" in message
    assert "Dispatch with dense masks instead" in message
    snapshot.assert_unchanged()


# --- CTC loss with per-call lengths ---------------------------------------------------


class Transcriber(nn.Module):
    """Frame features to log-probabilities over 5 symbols (0 is CTC's blank)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 5)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.proj(frames).log_softmax(-1)


def ctc_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    frames: torch.Tensor,
    targets: torch.Tensor,
    frame_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
) -> torch.Tensor:
    log_probs = model(frames).transpose(0, 1)  # time, batch, symbols
    loss = F.ctc_loss(log_probs, targets, frame_lengths, target_lengths)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def ctc_batch(seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    frames = torch.randn(3, 12, 8, generator=generator)
    targets = torch.randint(1, 5, (3, 4), generator=generator)
    frame_lengths = torch.randint(8, 13, (3,), generator=generator)
    target_lengths = torch.randint(1, 5, (3,), generator=generator)
    return frames, targets, frame_lengths, target_lengths


def make_transcriber() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transcriber()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_ctc_loss_with_lengths_that_change_at_every_call_trains_like_eager() -> None:
    # The eager backend runs aten's CTC loss and its backward at each call's lengths.
    model, optimizer = make_transcriber()
    python_code, cache = pg.precompile(
        ctc_step, model, optimizer, *ctc_batch(0), backend="eager"
    )
    step = pg.load(python_code, cache)
    twin, twin_optimizer = make_transcriber()
    lengths = set()
    for seed in range(1, 5):
        batch = ctc_batch(seed)
        lengths.add((tuple(batch[2].tolist()), tuple(batch[3].tolist())))
        torch.testing.assert_close(
            step(model, optimizer, *batch), ctc_step(twin, twin_optimizer, *batch)
        )
        torch.testing.assert_close(model.state_dict(), twin.state_dict())
    assert len(lengths) == 4


def test_ctc_loss_on_inductor_is_refused_naming_the_op_and_the_fix() -> None:
    model, optimizer = make_transcriber()
    args = (model, optimizer, *ctc_batch(0))
    snapshot = StateSnapshot(*args)
    with pytest.raises(pg.PrecompileError) as caught:
        pg.precompile(ctc_step, *args, backend="inductor")
    message = str(caught.value)
    for text in ("aten._ctc_loss.Tensor", "values of its inputs", "backend='eager'"):
        assert text in message, f"{text!r} not in the message: {message}"
    assert "decompositions" not in message
    snapshot.assert_unchanged()
    assert not optimizer.state
