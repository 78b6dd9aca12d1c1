"""Codegen: ``CaptureResult`` -> artifact text, through the templates only.

``render`` fills the templates; ``stubs`` renders them into type-checkable modules;
the rest is what rendering and the tools share about the artifact's text.
"""
