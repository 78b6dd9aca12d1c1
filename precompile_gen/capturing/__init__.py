"""Capture: ``fn(model, *example_inputs)`` traced into one ATen graph, and what the
trace assumed recorded for the ``CaptureResult`` (``trace``; ``precompile_gen.lowering``
lowers its graph).

Tracing refuses what the artifact cannot repeat; the other modules here each record
one part of the calling convention (aliasing, dynamic dims, Python values, gradient
resets, optimizers, DDP and DTensor arguments) for the renderer to emit.
"""
