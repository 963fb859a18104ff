"""Habits of DDP training loops met by a ParallelModule (issue 64, habits 6, 9, 10 and
11), on real gloo ranks; run by test_loop_habits.py.  Every rank runs each case; a case
returns what every rank saw (all-gathered) where the test asserts that each rank got
the same answer or the same clear error."""

from __future__ import annotations

import copy
import gc
import os
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from autopar import MeshSpec, auto_parallel
from autopar.runtime.mesh import reset
from tests.dist.silent_cases import Three, _all, _batch, _outcome

DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}
# Megatron-style tensor parallel: fc1 column-parallel, fc2 row-parallel
TP = {**DP, "input:0": "R", "input:1": "R", "fc1.weight": "S(0)", "fc1.bias": "S(0)",
      "fc2.weight": "S(1)"}
PLANS = {"dp": (DP, {"zero_stage": 0}), "tp": (TP, {"zero_stage": 0}),
         "zero2": (DP, {"zero_stage": 2}), "zero3": (DP, {"zero_stage": 3})}


def _module(model: nn.Module, c: dict):
    pins, opts = PLANS[c["plan"]]
    x, y = _batch()
    reset()
    return auto_parallel(model, example_inputs=(x, y), mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                         pins=pins, search="ilp", **opts)


def _train(module: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 20) -> list[float]:
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = module(*_batch(seed=seed + i))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full(pm) -> dict[str, torch.Tensor]:
    return pm.full_state_dict()


def _err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


# ---------------------------------------------------------------- habit 6
def optimizer_first(c: dict) -> dict:
    """``opt = AdamW(model.parameters())`` before ``auto_parallel``, then training pm:
    the first step raises on every rank; an unrelated model's optimizer, and one
    training the original model itself after ``auto_parallel``, step as always."""
    torch.manual_seed(0)
    model = Three()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pm = _module(model, c)
    before = _full(pm)
    res = {"stale": _all(_outcome(lambda opt=opt: _train(pm, opt, 1)))}
    res["moved"] = _err(_full(pm), before)  # whatever the step did, pm's weights
    other = nn.Linear(4, 4)
    w = other.weight.detach().clone()
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.ones(2, 4)).sum().backward()
    other_opt.step()
    res["other_moved"] = (other.weight - w).abs().max().item()
    # the original model trained on its own (a reference): its fresh gradients say so
    own = torch.optim.SGD(model.parameters(), lr=0.1)
    res["own"] = _outcome(lambda m=model, o=own: _train(m, o, 1))
    # the per-step cost of this check's process-wide step pre-hook on that optimizer
    from torch.optim.optimizer import _global_optimizer_pre_hooks as hooks
    ours = [h for h in hooks.values() if h.__module__ == "autopar.module.habits"]
    t0 = time.perf_counter()
    for _ in range(10000):
        for h in ours:
            h(other_opt, (), {})
    res["hook_us"] = (time.perf_counter() - t0) / 10000 * 1e6
    # the checks hold the replaced model weakly: gone with the user's references to it
    gone = weakref.ref(model)
    del model, opt, own
    gc.collect()
    res["model_freed"] = gone() is None
    return res


# ---------------------------------------------------------------- habit 9
def ema(c: dict) -> dict:
    """``AveragedModel(pm)`` with an EMA over 3 steps: the EMA model's loss is the
    single-process EMA's; the copy and pm are independent."""
    torch.manual_seed(0)
    model = Three()
    ref = copy.deepcopy(model)
    pm = _module(model, c)
    avg, ref_avg = (AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.75)) for m in (pm, ref))
    opt = torch.optim.AdamW(pm.parameters(), lr=5e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=5e-2)
    x, y = _batch(seed=5)
    res = {"emas": [], "ref_emas": []}
    for i in range(3):  # the EMA evaluated after every update, as a loop logs it
        _train(pm, opt, 1, seed=20 + i)
        _train(ref, ref_opt, 1, seed=20 + i)
        avg.update_parameters(pm)
        ref_avg.update_parameters(ref)
        res["emas"].append(avg(x, y).item())
        res["ref_emas"].append(ref_avg(x, y).item())
    res |= {"ema": res["emas"][-1], "ref_ema": res["ref_emas"][-1], "pm": pm(x, y).item(),
            "ref": ref(x, y).item()}
    # independent: the copy's parameters move, pm's output stays, and vice versa
    with torch.no_grad():
        for p in avg.module.parameters():
            p.mul_(0.5)
    res["ema_after"], res["pm_after"] = avg(x, y).item(), pm(x, y).item()
    _train(pm, opt, 1, seed=30)
    res["ema_after_pm_step"] = avg(x, y).item()
    res["every_rank"] = _all(res["ema"])
    return res


def clone_pipeline(c: dict) -> dict:
    """``copy.deepcopy`` of a pipelined module (two stages, two micro-batches): the copy
    runs ``train_step`` to pm's loss; halving the copy's weights moves its loss only."""
    import gpt

    torch.manual_seed(0)
    model, ex = gpt.build(layers=2)
    reset()
    pm = auto_parallel(model, example_inputs=ex, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                       pipeline_stages=2, micro_batches=2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm.train_step(*ex)
    opt.step()
    opt.zero_grad()
    twin = copy.deepcopy(pm)
    res = {"pm": pm.train_step(*ex).item(), "copy": twin.train_step(*ex).item()}
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    res["copy_half"], res["pm_again"] = twin.train_step(*ex).item(), pm.train_step(*ex).item()
    return res


# ---------------------------------------------------------------- habit 10
def hf_save(c: dict) -> dict:
    """Train a tiny HF Llama under ``auto_parallel``; ``model.save_pretrained`` raises
    on every rank (and on rank 0 alone, without a hang); ``pm.save_pretrained`` writes
    what ``from_pretrained`` reloads as the single-process trained weights."""
    import hf_zoo
    import transformers as tf

    model, batch = hf_zoo.build("llama")
    ref = copy.deepcopy(model)
    reset()
    # data parallel: every weight replicated, input_ids and labels split on the batch
    pins = {"*": "R", **hf_zoo.tp_pins("llama", (2,))} if c["plan"] == "tp" else \
        {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}
    pm = auto_parallel(model, example_kwargs=batch, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                       pins=pins, search="ilp", zero_stage=3 if c["plan"] == "zero3" else 0)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)  # as test_hf_models.py
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(2):
        for m, o in ((pm, opt), (ref, ref_opt)):
            o.zero_grad()
            m(**batch).loss.backward()
            o.step()
    d = _all(tempfile.mkdtemp() if dist.get_rank() == 0 else None)[0]
    res = {"dp_size": pm.data_parallel_size, "model_save": _all(_outcome(lambda: model.save_pretrained(os.path.join(d, "stale")))),
           "stale_written": os.path.exists(os.path.join(d, "stale", "model.safetensors"))}
    if dist.get_rank() == 0:  # DDP's habit: rank 0 alone saves
        res["rank0_save"] = _outcome(lambda: model.save_pretrained(os.path.join(d, "stale0")))
    res["pm_save"] = _all(_outcome(lambda: pm.save_pretrained(os.path.join(d, "trained"))))
    if any("error" in o for o in res["pm_save"]):
        return res
    loaded = tf.LlamaForCausalLM.from_pretrained(os.path.join(d, "trained")).state_dict()
    want = ref.state_dict()
    res["reload_err"] = _err(loaded, want)
    res["pm_err"] = _err(loaded, pm.full_state_dict())  # the file holds pm's weights
    res["untrained_err"] = _err(hf_zoo.build("llama")[0].state_dict(), want)
    res["keys_equal"] = sorted(loaded) == sorted(want)
    return res


# ---------------------------------------------------------------- habit 11
def rank0_file(c: dict) -> dict:
    """Rank 0 ``torch.save``s ``{"model": pm.state_dict(), "optim": opt.state_dict()}``,
    every rank loads it (the DDP tutorial).  Sharded state raises on every rank (the
    model's, tensor-parallel or ZeRO, at ``load_state_dict``; the optimizer's at its next step); replicated state loads
    and resumes exactly.  Each rank saving and loading its own file loads right."""
    torch.manual_seed(0)
    model = Three()
    pm = _module(model, c)
    opt = torch.optim.AdamW(pm.parameters(), lr=5e-2)
    _train(pm, opt, 2)
    saved = _full(pm)
    d = _all(tempfile.mkdtemp() if dist.get_rank() == 0 else None)[0]
    one, own = os.path.join(d, "ck.pt"), os.path.join(d, f"ck{dist.get_rank()}.pt")
    ck = {"model": pm.state_dict(), "optim": opt.state_dict()}
    if dist.get_rank() == 0:
        torch.save(ck, one)
    torch.save(ck, own)
    dist.barrier()
    step3 = _train(pm, opt, 1, seed=40)[0]
    res = {}
    for name, path in (("rank0", one), ("own", own)):
        ck = torch.load(path)  # the tutorial's call (weights_only: DTensors load so)
        res[name] = {"model": _all(_outcome(lambda ck=ck: bool(pm.load_state_dict(ck["model"]) or True)))}
        res[name]["model_err"] = _err(_full(pm), saved)
        if "error" in res[name]["model"][0]:  # put the right weights back: the optimizer is next
            pm.load_state_dict(saved)
        opt.load_state_dict(ck["optim"])
        res[name]["resume"] = _all(_outcome(lambda: _train(pm, opt, 1, seed=40)[0]))
        res[name]["step3"] = step3
    return res


def run(c: dict) -> dict:
    """Dispatch ``c["fn"]``."""
    return globals()[c["fn"]](c)
