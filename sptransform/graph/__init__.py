"""What a graph *is*: node facts, placements and their rules, the model analysis, layer regions.

Imports nothing of sptransform but ``capture`` and ``torch_internals``: no pass, no runtime.
"""
