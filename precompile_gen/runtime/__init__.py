"""Runtime: everything a process that only loads artifacts imports, and nothing else.

``load`` checks an ``(python_code, cache)`` pair and executes it; the cache, the
kernel binaries it carries, the crash-safe files and ``PrecompileError`` live here so
that loading never imports the tracer, Inductor's compiler, Jinja or black.
"""
