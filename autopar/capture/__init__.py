"""Capture: a user's ``nn.Module`` as one aten-level ``torch.fx`` graph with shapes,
dtypes, FLOPs and bytes on every node.

Owns ``torch.export`` capture and its checks (``trace``, ``checks``, ``hf_experts``,
``batch``), the IR's per-node metadata (``ir``, ``annotate``, ``grad_flow``), layers
(``layers``) and the transforms capture applies before planning (``grad_regions``,
``mixed_precision``, ``scalar_reads``, ``side_views``).  It may import
:mod:`autopar.runtime` (the custom ops a model is captured with), :mod:`autopar.plans`,
:mod:`autopar.cost_models` and :mod:`autopar.errors`.
"""
