"""The runtime support: the code every artifact of this version carries verbatim as
its section 4, as plain modules that ruff and pyrefly check.

``render`` reads each part as text; the base part (``support``) and the parts that
read no metadata (``render.CONVENTION_PARTS``) are also imported by capture and
``inspect`` (``capturing.convention``), so that they apply the calling convention by
the artifact's own code. A part's lines above its first "# ---" heading are not
carried: they import what the rest of the artifact defines (``declarations`` holds
the names the artifact's other sections define), for checking the part as a module.
"""
