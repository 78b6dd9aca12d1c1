# Runtime support for the eager backend's graph: carried last by every eager
# artifact, from its first "# ---" heading on.
# The lines above that heading are not carried: they import what the base part
# defines, so that ruff and pyrefly check this part as a module of its own.
from precompile_gen.runtime_support.support import _forget_checks, _raise_refused_side

# isort: split

# --- The captured graph's run -------------------------------------------------------
from collections.abc import Callable
from typing import Any

import torch


def _run_captured(call: Callable[[list[Any]], list[Any]], inputs: list[Any]) -> Any:
    """The captured ATen graph's flat outputs for ``inputs``. The graph already
    contains the backward ops it needs; recording autograd history for them would
    only cost memory. Grad mode is switched directly: entering torch.no_grad() costs
    more than a small driver's checks."""
    grad_enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return call(inputs)
    except BaseException as error:
        _forget_checks()
        _raise_refused_side(error)
        raise
    finally:
        torch._C._set_grad_enabled(grad_enabled)
