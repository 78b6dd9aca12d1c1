"""The one exception type for contract violations.

Kept free of torch imports: an emitted artifact imports this module lazily, on its
error path only, so that callers can catch the same type whether the error came from
capture, from ``load`` or from inside the artifact's driver.
"""


class PrecompileError(RuntimeError):
    """A capture, load or runtime call broke the precompile contract.

    The message names what differed, what was expected and how to fix it.
    """
