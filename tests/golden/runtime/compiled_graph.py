# --- The compiled graph's run -------------------------------------------------------
import sys
from collections.abc import Callable
from typing import Any

import torch


def _run_compiled(call: Callable[[list[Any]], list[Any]], inputs: list[Any]) -> Any:
    """The compiled graph's flat outputs for ``inputs``; Inductor's own layout asserts,
    should one still object, reported in the driver's terms."""
    if globals().get("_DEFERRED_KERNEL_SCOPES"):
        # Executed other than by precompile_gen.load: the kernels are built now.
        _resolve_kernels(globals())
    try:
        return call(inputs)
    except AssertionError as error:
        _forget_checks()
        # The layouts were checked before; should Inductor's own assert_size_stride
        # still object, say so in the same terms. Any other assertion is not ours to
        # reinterpret.
        text = str(error)
        if not (
            ("expected size" in text and "stride" in text)
            or "wrong number of dimensions" in text
        ):
            raise
        _fail(
            "a tensor passed to the compiled graph has a size or memory layout "
            "(strides) other than the example's, which the inductor backend "
            "specialises on. Pass tensors in the example's layout (.contiguous() for "
            "a contiguous example), or capture with backend='eager'. Inductor "
            f"reported: {text.splitlines()[0] if text else text}"
        )
    except BaseException as error:
        _forget_checks()
        _raise_refused_side(error)
        raise


def _run_compiled_at_branches(
    call: Callable[[list[Any]], list[Any]], inputs: list[Any]
) -> Any:
    """``_run_compiled``, for a graph that may refuse a call at a branch on a
    tensor's value. AOTAutograd counts a version of each input the graph writes
    before the graph runs: a call the graph refuses gets its inputs' counters back,
    as it leaves their values."""
    versions = [
        (tensor, tensor._version)
        for tensor in inputs
        if isinstance(tensor, torch.Tensor) and not tensor.is_inference()
    ]
    try:
        return _run_compiled(call, inputs)
    except BaseException:
        moved = [
            (tensor, count) for tensor, count in versions if tensor._version != count
        ]
        if moved:
            from torch._C._autograd import _unsafe_set_version_counter

            tensors, counts = zip(*moved, strict=True)
            _unsafe_set_version_counter(tensors, counts)
        raise


# --- Compiled kernels ---------------------------------------------------------------
def _resolve_kernels(namespace: dict[str, Any]) -> None:
    """Build the kernels an inductor artifact's graph section deferred, in place of
    their records in the scopes it waited on. Its AsyncCompile stand-in only records
    them, since it runs before this section is defined; precompile_gen.load calls this
    right after executing the artifact, forward() at its first call otherwise. Once
    they are built (or in an artifact without kernels) there is nothing to do."""
    scopes = namespace.get("_DEFERRED_KERNEL_SCOPES")
    if not scopes:
        return
    # Concurrent first calls wait for the one building: Inductor's compiler state is
    # process-global, and no call may run a kernel that is still a record.
    with _kernels_lock(namespace):
        builder = _KernelBuilder(
            namespace["_DeferredKernel"], namespace.get("__kernel_binaries__", {})
        )
        for scope in scopes:
            built = {
                name: builder.build(value)
                for name, value in list(scope.items())
                if type(value) is builder.deferred
            }
            # Inductor may hand back a kernel still compiling (a future): wait for
            # those before any is bound where the graph calls it.
            builder.wait(built)
            scope.update(built)
        scopes.clear()


def _kernels_lock(namespace: dict[str, Any]) -> Any:
    import threading

    # setdefault is atomic: every thread gets the one lock, whichever made it.
    return namespace.setdefault("_KERNELS_LOCK", threading.Lock())


class _KernelBuilder:
    """Builds deferred kernels: a C++ kernel whose binary is in place (by the sha256
    of its source, in ``binaries``) is imported from it; any other kernel goes to
    Inductor's own AsyncCompile, imported only then, which compiles it from its
    source as Inductor's module would have."""

    def __init__(self, deferred: type, binaries: dict[str, str]) -> None:
        self.deferred = deferred
        self._binaries = binaries
        self._inductor: Any = None
        self._built: dict[int, object] = {}

    def build(self, kernel: Any) -> object:
        # By identity: a kernel another one takes (a multi-kernel's choices) is built
        # once, whether it is reached by its name or through the other.
        if id(kernel) not in self._built:
            self._built[id(kernel)] = self._build(
                kernel.kind, kernel.args, kernel.kwargs
            )
        return self._built[id(kernel)]

    def wait(self, built: dict[str, object]) -> None:
        if self._inductor is not None:
            self._inductor.wait(built)

    def _build(
        self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> object:
        # Binaries stand in for the two-argument form only; other calls go to Inductor.
        if kind == "cpp_pybinding" and len(args) == 2 and not kwargs:
            kernel = self._binary_kernel(args[1])
            if kernel is not None:
                return kernel
        method = getattr(self._compiler(), kind)
        return method(
            *[self._argument(value) for value in args],
            **{key: self._argument(value) for key, value in kwargs.items()},
        )

    def _argument(self, value: object) -> object:
        # A multi-kernel takes the kernels it picks from, in a list or a dict.
        if type(value) is self.deferred:
            return self.build(value)
        if isinstance(value, list):
            return [self._argument(item) for item in value]
        if isinstance(value, dict):
            return {key: self._argument(item) for key, item in value.items()}
        return value

    def _binary_kernel(self, source: str) -> object | None:
        import hashlib
        import warnings

        path = self._binaries.get(hashlib.sha256(source.encode()).hexdigest())
        if path is None:
            return None
        try:
            return _import_kernel(path)
        except (ImportError, OSError) as error:
            warnings.warn(
                f"the kernel binary {path} cannot be imported here ({error}); "
                "compiling the kernel from its source instead",
                stacklevel=2,
            )
            return None

    def _compiler(self) -> Any:
        if self._inductor is None:
            from torch._inductor.async_compile import AsyncCompile

            self._inductor = AsyncCompile()
        return self._inductor


def _import_kernel(path: str) -> object:
    # As Inductor imports a kernel binary: a module named after the binary's key, whose
    # initialisation reads the address of torch's tensor-data accessor (absent from
    # torch's type stubs) from this variable.
    import importlib.util
    import os

    accessor = torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr  # type: ignore[attr-defined]
    os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(accessor)
    name = os.path.basename(path).split(".")[0] + ".kernel"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name].kernel
