"""dzc's graph passes, one file per pass, each a function fx.Graph -> PassResult (see graph_pass.py).

The order they run in is not decided here: each target's pipeline lists it (dzc/pipeline.py).
"""
