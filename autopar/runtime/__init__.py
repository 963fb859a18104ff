"""What runs inside a training step: the process groups of the mesh (``mesh``), the
collectives and local op forms generated code calls (``collectives``, ``ops``, ``rng``,
``ring_attention``, ``context``, ``experts``, ``pending``), and the machinery a step
runs around the graph (gradient buckets, ZeRO, the pipeline runner, parameters as
DTensors, agreement between ranks).

Exported ``module.py`` files import the generated code's callables from here by module
path, so those paths stay put.  It may import only :mod:`autopar.plans`,
:mod:`autopar.cost_models` and :mod:`autopar.errors`.
"""
