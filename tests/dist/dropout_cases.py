"""Dropout on real ranks (run by test_dropout.py): the parallel module, seeded with
``pm.manual_seed(s)``, against the single-process model after ``torch.manual_seed(s)``."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar import MeshSpec, auto_parallel
from autopar.runtime.mesh import reset


class Block(nn.Module):
    """Linear, ReLU, dropout: a layer recomputation can replay."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.drop = nn.Dropout(p)

    def forward(self, h):
        return self.drop(F.relu(self.fc(h)))


class DropNet(nn.Module):
    """Input projection, two dropout blocks, a regression head."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList([Block(p), Block(p)])
        self.head = nn.Linear(32, 8)

    def forward(self, x, y):
        h = self.drop(self.inp(x))
        for b in self.blocks:
            h = b(h)
        return F.mse_loss(self.head(h), y)


def _compare(pm, ref, ex, seed: int) -> dict:
    pm.manual_seed(seed)
    loss = pm.train_step(*ex)
    torch.manual_seed(seed)
    # micro-batches draw their masks one micro-batch after the other (still independent);
    # the single process does the same when it accumulates over the same micro-batches
    m = pm.plan.decisions.micro_batches
    b = ex[0].shape[0] // m
    rl = sum(ref(*(x[i * b:(i + 1) * b] for x in ex)) for i in range(m)) / m
    rl.backward()
    grads = pm.full_grads()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, float(loss))
    return {"losses": every, "ref": float(rl),
            "grad_err": max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()),
            "grad_scale": max(p.grad.abs().max().item() for p in ref.parameters())}


def run(c: dict) -> dict:
    """One plan of DropNet (or HF GPT-2 with dropout) under ``c``'s pins and options."""
    torch.manual_seed(0)
    if c.get("model") == "gpt2":
        import transformers as tf
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=8,
                            resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 64, (4, 8))

        class Loss(nn.Module):  # positional call for the shared comparison helper
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, ids, labels):
                return self.m(input_ids=ids, labels=labels).loss

        model, ex = Loss(model), (ids, ids)
    else:
        model = DropNet()
        g = torch.Generator().manual_seed(1)
        ex = (torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g))
    ref = copy.deepcopy(model)
    reset()
    pm = auto_parallel(model, example_inputs=ex, mesh=MeshSpec.preset("cpu-gloo", shape=tuple(c["mesh"])),
                       pins=c.get("pins", {}), search="ilp", **c.get("options", {}))
    # a pipeline draws its masks in another order than one process: eval only
    res = {"losses": [], "ref": 0.0, "grad_err": 0.0, "grad_scale": 0.0} \
        if c.get("eval_only") else _compare(pm, ref, ex, seed=11)
    # eval(): no dropout, deterministic; train() again draws new masks
    pm.eval()
    ref.eval()
    want = float(ref(*ex))
    if pm.runner is None:
        res["eval_err"] = abs(float(pm(*ex)) - want)
    else:  # micro-batched: every stage graph (each chunk of an interleaved rank) in eval
        errs = []
        for seed in (3, 4):
            pm.manual_seed(seed)
            errs.append(abs(float(pm.train_step(*ex)) - want))
        res["eval_err"] = max(errs)
    pm.train()
    return res
