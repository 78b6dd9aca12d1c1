"""Lowering: the traced graph -> a ``CompiledGraph`` (``lower``).

The eager backend's graph becomes fx's Python source; the inductor backend's goes
through AOTAutograd and Inductor (with ``recompute``, the post-grad pass that
recomputes cheap activations for the backward), whose C++ kernels are built to the
same bytes in any cache folder (``kernel_builds``). ``inductor_imports`` rewrites
the imports of Inductor's module so that loading needs no compiler, and
``inductor_module`` is what lowering reads of that module.
"""
