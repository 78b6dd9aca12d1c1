"""Tools: the command line and what it runs (inspect, verify, diff, the demo), and
the progress and timing reports of long stages.
"""
