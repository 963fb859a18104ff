"""The model's own activation checkpointing becomes recomputation the plan keeps
(:mod:`autopar.capture.user_checkpoint`), planned on a preset mesh, single process.

Hugging Face's ``gradient_checkpointing_enable()`` and a hand-written
``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` leave no trace in
the exported graph; the plan must still recompute the layers they cover, say so, and
recompute nothing more (nor less) than the memory budget asks on top.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

import autopar
from autopar import MeshSpec
from autopar.capture.layers import layer_keys
from autopar.capture.trace import capture
from autopar.capture.user_checkpoint import region_of

MESH = MeshSpec.preset("cpu-gloo", shape=(2,))


def _llama(checkpointing: dict | None, layers: int = 2):
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32)
    model = tf.LlamaForCausalLM(cfg).train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(**checkpointing)
    ids = torch.randint(0, 64, (4, 8))
    return model, {"input_ids": ids, "labels": ids}


class Block(nn.Module):
    """A pre-norm MLP block; ``part=True`` checkpoints only its MLP, as some users do."""

    def __init__(self, d: int = 32, part: bool = False) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2, self.part = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d), part

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The block's MLP."""
        return self.fc2(torch.nn.functional.gelu(self.fc1(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual MLP."""
        h = self.ln(x)
        return x + (checkpoint(self.mlp, h, use_reentrant=False) if self.part else self.mlp(h))


class Net(nn.Module):
    """Three blocks; ``whole`` lists the blocks the forward checkpoints whole."""

    def __init__(self, whole: tuple[int, ...] = (), part: bool = False, reentrant: bool = False) -> None:
        super().__init__()
        self.emb, self.head, self.whole = nn.Linear(16, 32), nn.Linear(32, 1), whole
        self.blocks = nn.ModuleList(Block(part=part) for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A squared-output loss."""
        h = self.emb(x)
        for i, b in enumerate(self.blocks):
            h = checkpoint(b, h, use_reentrant=self.reentrant) if i in self.whole else b(h)
        return self.head(h).pow(2).mean()


def _net_plan(net: Net, **opts) -> autopar.Plan:
    torch.manual_seed(0)
    # rows enough that activations, not the end of backward's gradients, make the peak
    return autopar.plan(net, (torch.randn(512, 16),), mesh=MESH, **opts)


def test_hf_gradient_checkpointing_recomputes_every_decoder_layer() -> None:
    model, batch = _llama({})
    plan = autopar.plan(model, example_kwargs=batch, mesh=MESH)
    assert plan.decisions.recompute == ["model.layers.0", "model.layers.1"]
    words = plan.explain("recompute")
    assert "kept as the model's own activation checkpointing asks" in words, words
    assert "as the model's own checkpointing asks" in plan.explain("model.layers.1")
    assert "recompute" in plan.summary() and "model's own activation checkpointing" in plan.summary()


def test_hf_in_eval_mode_still_plans_its_training_checkpoints() -> None:
    """``from_pretrained`` returns the model in eval mode, where HF runs no checkpoint;
    ``auto_parallel`` then ``pm.train()`` trains it with the plan captured in eval mode."""
    model, batch = _llama({})
    plan = autopar.plan(model.eval(), example_kwargs=batch, mesh=MESH)
    assert plan.decisions.recompute == ["model.layers.0", "model.layers.1"]


def test_hf_without_checkpointing_recomputes_nothing() -> None:
    model, batch = _llama(None)
    plan = autopar.plan(model, example_kwargs=batch, mesh=MESH)
    assert plan.decisions.recompute == []
    assert "no layer is recomputed" in plan.explain("recompute")


def test_hf_every_other_layer_is_what_the_plan_keeps() -> None:
    """``every_n_layers=2`` checkpoints layer 0 only: the plan reads the model's choice."""
    model, batch = _llama({"every_n_layers": 2})
    plan = autopar.plan(model, example_kwargs=batch, mesh=MESH)
    assert plan.decisions.recompute == ["model.layers.0"]


def test_every_third_of_eight_layers_through_the_shallow_estimates() -> None:
    """Eight layers: the search estimates from a copy cut to a few layers
    (autopar/search/shallow.py) and plans the chosen split at full depth; the plan
    recomputes exactly the layers the model checkpoints."""
    model, batch = _llama({"every_n_layers": 3}, layers=8)
    plan = autopar.plan(model, example_kwargs=batch, mesh=MESH)
    assert plan.decisions.recompute == ["model.layers.0", "model.layers.3", "model.layers.6"]


def test_capture_marks_the_regions_ops_by_layer() -> None:
    """Every op of a checkpointed HF decoder layer carries its region (one per layer),
    and no op outside the layers does."""
    model, batch = _llama({})
    gm = capture(model, (), batch).gm
    keys = layer_keys(gm)
    regions: dict[str, set] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            regions.setdefault(keys[n], set()).add(region_of(n))
    assert regions["pre"] == {None} and regions["post"] == {None}
    r0, r1 = regions["model.layers.0"], regions["model.layers.1"]
    assert len(r0) == len(r1) == 1 and None not in r0 | r1 and r0 != r1


def test_hand_written_checkpoint_is_recomputed() -> None:
    assert _net_plan(Net(whole=(0, 1, 2))).decisions.recompute == ["blocks.0", "blocks.1", "blocks.2"]
    assert _net_plan(Net()).decisions.recompute == []


def test_a_region_inside_a_layer_recomputes_the_layer_and_says_so() -> None:
    plan = _net_plan(Net(part=True))
    assert plan.decisions.recompute == ["blocks.0", "blocks.1", "blocks.2"]
    assert "checkpoints only part of blocks.0, blocks.1, blocks.2" in plan.explain("recompute")
    assert "for part of it; recomputed whole" in plan.explain("blocks.2")


def test_a_memory_budget_recomputes_more_but_never_less() -> None:
    """The model checkpoints blocks.0; a budget that fits only as tightly as with every
    block recomputed makes the search add more, and keep blocks.0."""
    # data-parallel, no ZeRO: other placements and ZeRO would save memory too, and the
    # budget is sized for recomputation
    dp = {"pins": {"*": "R", "input:0": "S(0)"}, "zero_stage": 0, "micro_batches": 1}
    every = _net_plan(Net(), recompute=["blocks.0", "blocks.1", "blocks.2"], **dp)
    budget = every.memory["total"] * 1.001  # the fit itself, not a float's rounding
    tight = _net_plan(Net(whole=(0,)), memory_budget=budget, **dp)
    rc = tight.decisions.recompute
    assert rc[0] == "blocks.0" and len(rc) >= 2, rc
    assert tight.memory["total"] <= budget
    assert "1 of them (blocks.0) kept" in tight.explain("recompute")
    assert _net_plan(Net(whole=(0,))).decisions.recompute == ["blocks.0"]


def test_reentrant_checkpoint_is_captured_with_its_gradients() -> None:
    """``use_reentrant=True`` runs the block under ``no_grad`` in the forward: captured as
    it was, the loss came out detached.  Now the captured graph gives the eager model's
    loss and gradients (the same ops in the same order: bitwise), and the plan
    recomputes the blocks."""
    torch.manual_seed(0)
    net, x = Net(whole=(0, 1, 2), reentrant=True), torch.randn(8, 16)
    eager = copy.deepcopy(net)  # the captured graph holds the model's own parameters
    gm = capture(net, (x,)).gm
    loss = gm(x)[0]
    assert loss.requires_grad
    loss.backward()
    ref = eager(x)
    ref.backward()
    assert torch.equal(loss, ref)
    graph_grads = dict(gm.named_parameters())
    for name, p in eager.named_parameters():
        assert torch.equal(graph_grads[name].grad, p.grad), name
    assert _net_plan(Net(whole=(0, 1, 2), reentrant=True)).decisions.recompute == \
        ["blocks.0", "blocks.1", "blocks.2"]


def test_a_schedule_that_cannot_recompute_is_refused_by_name() -> None:
    """The zero-bubble schedule cannot recompute: forced with a checkpointing model it is
    a clear error naming both (before: planned without recomputing anything, silently)."""
    with pytest.raises(autopar.errors.PlanError, match="schedule='zero-bubble' cannot run the model's own"):
        _net_plan(Net(whole=(0, 1, 2)), pipeline_stages=2, micro_batches=2, schedule="zero-bubble")


def test_torch_checkpoint_wrapper_is_recomputed() -> None:
    """torch's ``apply_activation_checkpointing`` (FSDP/torchtitan's habit) wraps each
    block in ``checkpoint_wrapper``: the same non-reentrant checkpoint underneath."""
    net = Net()
    apply_activation_checkpointing(net, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda m: isinstance(m, Block))
    assert _net_plan(net).decisions.recompute == ["blocks.0", "blocks.1", "blocks.2"]
