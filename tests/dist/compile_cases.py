"""``torch.compile(pm)`` and ``compile=True`` in an ordinary training loop on real gloo
ranks, against the single-process model; run by test_torch_compile.py.

:func:`run` trains ``torch.compile(pm)`` (or ``pm`` built with ``compile=True``) with
AdamW, ``clip_grad_norm_`` and ``train()``/``eval()`` beside the plain model (and, when
asked, beside an uncompiled ``pm`` of the same plan), and returns what rank 0 saw.
"""

from __future__ import annotations

import copy
import importlib
import os
import time

import torch
import torch.distributed as dist

from autopar import MeshSpec, auto_parallel
from autopar.runtime.mesh import reset
from tests.dist.harness import _dynamo_graphs, _max_err


def _model(kind: str):
    """(model, positional inputs, keyword inputs): the Hugging Face Llama of issue 64
    called as ``model(**batch)``, or examples/gpt.py's 2-layer GPT or examples/mlp.py."""
    if kind == "llama":
        import hf_llama

        model, _, kw = hf_llama.build(batch=4, seq=16)
        return model, (), {**kw, "attention_mask": torch.ones_like(kw["input_ids"])}
    mod = importlib.import_module(kind)
    model, ex = mod.build(**({"layers": 2} if kind == "gpt" else {}))
    return model, tuple(ex), {}


def _loss(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out["loss"]


def _train(model, opt, args, kwargs, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` of the ordinary loop; returns the losses and the clipped norms."""
    losses, norms = [], []
    for _ in range(steps):
        model.train()
        opt.zero_grad()
        loss = _loss(model(*args, **kwargs))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        losses.append(loss.item())
    return losses, norms


def _plan(model, args, kwargs, c: dict):
    reset()
    return auto_parallel(model, example_inputs=args or None, example_kwargs=kwargs or None,
                         mesh=MeshSpec.preset("cpu-gloo", shape=(2,)), pins=c.get("pins", {}),
                         **c.get("options", {}))


def run(c: dict) -> dict:
    """Train ``c["model"]`` compiled (``c["how"]``: ``"torch.compile"`` or ``"compile="``)
    on 2 ranks; ``c["cache_dir"]`` sets ``TORCHINDUCTOR_CACHE_DIR`` first."""
    t0 = time.perf_counter()
    if c.get("cache_dir"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = c["cache_dir"]
    model, args, kwargs = _model(c["model"])
    ref, eager_model = copy.deepcopy(model), copy.deepcopy(model)
    how = c.get("how", "torch.compile")
    options = {**c.get("options", {}), **({"compile": True} if how == "compile=" else {})}
    pm = _plan(model, args, kwargs, {**c, "options": options})
    run_pm = torch.compile(pm) if how == "torch.compile" else pm
    names = [n for n, _ in ref.named_parameters()]
    res: dict = {"plan_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    # 1. loss and every gradient of the first step (synchronized: the full gradient)
    loss = _loss(run_pm(*args, **kwargs))
    loss.backward()
    rl = _loss(ref(*args, **kwargs))
    rl.backward()
    res["loss"], res["ref_loss"] = loss.item(), rl.item()
    res["grad_err"], res["grad_worst"] = _max_err(pm.full_grads(), {n: p.grad for n, p in ref.named_parameters()},
                                                  names)
    res["grad_scale"] = max(p.grad.abs().max().item() for p in ref.parameters())
    graphs = _dynamo_graphs()
    res["first_step_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # 2. the ordinary loop: AdamW, clip_grad_norm_, train()/eval()
    opt = torch.optim.AdamW(run_pm.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    res["losses"], res["norms"] = _train(run_pm, opt, args, kwargs, c.get("steps", 3))
    res["ref_losses"], res["ref_norms"] = _train(ref, ropt, args, kwargs, c.get("steps", 3))
    res["steps_s"] = time.perf_counter() - t0
    res["recompiled"] = _dynamo_graphs() - graphs  # a recompile per step would add graphs
    res["adam_err"], res["adam_worst"] = _max_err(pm.full_state_dict(), ref.state_dict(), names)
    run_pm.eval()
    ref.eval()
    with torch.no_grad():
        res["eval_loss"] = _loss(run_pm(*args, **kwargs)).item()
        res["ref_eval_loss"] = _loss(ref(*args, **kwargs)).item()
    res["compiled"] = pm.compiled
    res["aot_graphs"] = int(torch._dynamo.utils.counters["aot_autograd"]["total"])
    if c.get("eager"):  # the same plan uncompiled, the same loop
        epm = _plan(eager_model, args, kwargs, c)
        eopt = torch.optim.AdamW(epm.parameters(), lr=1e-3)
        loss = _loss(epm(*args, **kwargs))
        loss.backward()
        res["eager_loss"] = loss.item()
        res["eager_losses"], _ = _train(epm, eopt, args, kwargs, c.get("steps", 3))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, res["losses"])
    res["rank_losses"] = everyone
    return res
