"""What several test modules, and the scripts their child processes run, share.

Importing this package imports nothing: a script that must not import
precompile_gen imports only the modules it needs from it.
"""
