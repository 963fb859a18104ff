"""Golden plans: the planner's choices on cases whose right answer is known.

* A small MLP with a large batch on slow links gets data parallel: weights replicated,
  the batch sharded, no tensor-parallel collectives in the forward.
* A transformer block with a large hidden size on an 8-GPU NVLink node gets Megatron's
  pattern (q/k/v and fc1 column-sharded, fc2 row-sharded), and its cost is no higher
  than the plan with Megatron's weight placements pinned.
Both models are built on the meta device: planning allocates no weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from autopar.cost_models import LinkSpec
from torch import nn

from autopar import MeshSpec, plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import Block, GPTConfig  # noqa: E402
from mlp import MLP  # noqa: E402


def test_small_model_on_slow_links_gets_data_parallel() -> None:
    base = MeshSpec.preset("cpu-gloo", shape=(4,))
    # 100 MB/s links: moving activations between layers (TP) costs far more than one
    # bucketed all-reduce of 20 KB of gradients; the batch is large enough that
    # replicating the compute 4x costs more than that all-reduce
    slow = MeshSpec(shape=(4,), axis_names=("dp",), links=(LinkSpec(alpha=1e-4, beta=1e8),),
                    peak_flops=base.peak_flops, mem_bandwidth=base.mem_bandwidth,
                    mem_capacity=base.mem_capacity)
    with torch.device("meta"):
        model = MLP(64, 64, 8)
        ex = (torch.randn(65536, 64), torch.randn(65536, 8))
    p = plan(model, ex, slow)
    assert all(v == "R" for v in p.params().values()), p.params()
    assert p.nodes["linear"].in_placements[0] == "S(0)"  # the batch is sharded (x is sliced for free)
    # no tensor-parallel traffic between layers (the loss's all-reduce sits on the output)
    assert not [s for _, s in p.redistributions() if "all_reduce" not in s], p.redistributions()
    assert p.grad_sync_seconds > 0


class BlockLoss(nn.Module):
    """One pre-norm transformer block with a scalar loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.blk = Block(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blk(x).pow(2).mean()


MEGATRON = {"*q_proj.weight": "S(0)", "*k_proj.weight": "S(0)", "*v_proj.weight": "S(0)",
            "*fc1.weight": "S(0)", "*out_proj.weight": "S(1)", "*fc2.weight": "S(1)"}


def test_large_transformer_block_on_nvlink_gets_megatron() -> None:
    with torch.device("meta"):
        model = BlockLoss(GPTConfig(dim=8192, heads=64))
        x = torch.randn(8, 2048, 8192)
    mesh = MeshSpec.preset("8xA100-nvlink")
    free = plan(model, (x,), mesh)
    params = free.params()
    for w in ("q_proj", "k_proj", "v_proj"):
        assert params[f"blk.attn.{w}.weight"] == "S(0)", params
    assert params["blk.mlp.fc1.weight"] == "S(0)"
    assert params["blk.mlp.fc2.weight"] == "S(1)"
    pinned = plan(model, (x,), mesh, pins=MEGATRON)
    assert free.objective <= pinned.objective * (1 + 1e-9)
    # and much cheaper than pure data parallel, which all-reduces 3.2 GB of gradients
    dp = plan(model, (x,), mesh, pins={"*": "R", "input:0": "S(0)"})
    assert free.objective < dp.objective
