"""While capturing, Hugging Face experts modules call one op instead of their loop.

transformers' experts modules (``MixtralExperts``, ``Qwen2MoeExperts`` and the other
copies made by ``use_experts_implementation``) loop over the experts that received
tokens, with data-dependent ``nonzero``/``where``: exported, every routing op falls back
to replication.  :func:`experts_as_op` gives each such module, for the duration of the
capture, an instance ``forward`` that calls :data:`autopar.runtime.experts.MOE_EXPERTS`
(one node per layer, with its own sharding rule: autopar/sharding/rules/moe_experts.py); the
instance attribute is removed afterwards, so the user's model is unchanged.

A module is taken when its class name ends in ``Experts``, it holds 3-D parameters
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` and an ``act_fn`` autopar
recognises, and transformers' layout flags (if any) say concatenated gate/up, not
transposed, no bias, no post-expert norm, the default gate.  Anything else keeps its
own forward.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from autopar.runtime.experts import act_name, moe_experts


def experts_act(m: nn.Module) -> str | None:
    """The activation name when ``m`` is an experts module this op stands for, else None."""
    if not type(m).__name__.endswith("Experts"):
        return None
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor)
            and gu.dim() == 3 and dn.dim() == 3):
        return None
    e, two_i, h = gu.shape
    if dn.shape != (e, h, two_i // 2) or two_i % 2:
        return None
    flags = {"has_bias": False, "is_transposed": False, "has_post_expert_norm": False,
             "has_gate": True, "is_concatenated": True}
    if any(getattr(m, k, v) != v for k, v in flags.items()):
        return None
    apply_gate = getattr(type(m), "_apply_gate", None)
    if apply_gate is not None:
        from transformers.integrations import moe as hf_moe  # optional: transformers is an extra

        if apply_gate is not getattr(hf_moe, "_default_apply_gate", None):
            return None
    act = getattr(m, "act_fn", None)
    return act_name(act) if act is not None else None


def _forward(m: nn.Module, act: str):
    def forward(hidden_states, top_k_index, top_k_weights):
        return moe_experts(hidden_states, top_k_index, top_k_weights, m.gate_up_proj,
                           m.down_proj, act)
    return forward


@contextlib.contextmanager
def experts_as_op(model: nn.Module):
    """Within the block, every recognised experts module of ``model`` calls the op."""
    patched = []
    for m in model.modules():
        act = experts_act(m)
        if act is None:
            continue
        had = "forward" in vars(m)
        patched.append((m, had, vars(m).get("forward")))
        m.forward = _forward(m, act)
    try:
        yield len(patched)
    finally:
        for m, had, old in patched:
            if had:
                m.forward = old
            else:
                del m.forward


__all__ = ["experts_act", "experts_as_op"]
