"""``pm.generate`` on real gloo ranks (issue 65); run by test_generate.py.  Every rank
runs each case; a case returns what every rank saw (all-gathered) where the test asserts
that each rank got the same tokens or the same clear error."""

from __future__ import annotations

import copy
import gc
import weakref

import torch

from autopar import MeshSpec, auto_parallel
from autopar.runtime.mesh import reset
from tests.dist.silent_cases import Three, _all, _batch, _outcome

LR = 1e-3  # as test_hf_models.py


def _batches(steps: int, seed: int) -> list[dict]:
    """One (4, 16) Llama batch per step (the planned shape), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (4, 16), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _backward(m, batch: dict) -> None:
    """Forward and backward of ``batch`` (a pipelined module runs its schedule)."""
    if getattr(m, "runner", None) is not None:
        m.train_step(**batch)
    else:
        m(**batch).loss.backward()


def _step(pairs, batch: dict) -> None:
    """One AdamW step of every (module, optimizer) in ``pairs`` on ``batch``."""
    for m, o in pairs:
        o.zero_grad()
        _backward(m, batch)
        o.step()


def _options(plan: str) -> dict:
    """``auto_parallel``'s pins and options for ``plan``."""
    import hf_zoo

    if plan == "tp":  # Megatron-style: every projection split, inputs replicated
        return {"pins": {"*": "R", **hf_zoo.tp_pins("llama", (2,))}}
    if plan == "pp":  # two stages, two micro-batches: each rank holds one stage's weights
        return {"pipeline_stages": 2, "micro_batches": 2}
    # input_ids and labels split
    return {"pins": {"*": "R", "input:0": "S(0)", "input:1": "S(0)"},
            "zero_stage": 3 if plan == "zero3" else 0}


def hf_generate(c: dict) -> dict:
    """A tiny HF Llama trained 3 AdamW steps under ``auto_parallel`` and in one process:
    ``pm.generate`` (greedy, HF's KV cache) gives the single process's tokens on every
    rank; a second call gathers nothing; a training forward frees the copy; after an
    optimizer step, and after an in-place write to a parameter, it gathers again and
    follows."""
    import hf_zoo

    model, batch = hf_zoo.build("llama")
    ref = copy.deepcopy(model)
    prompt = batch["input_ids"][:2, :6]
    gen = {"input_ids": prompt, "max_new_tokens": 16, "do_sample": False}
    res = {"untrained": ref.generate(**gen).tolist()}
    reset()
    pm = auto_parallel(model, example_kwargs=batch, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                       search="ilp", **_options(c["plan"]))
    pairs = [(pm, torch.optim.AdamW(pm.parameters(), lr=LR)),
             (ref, torch.optim.AdamW(ref.parameters(), lr=LR))]
    steps = _batches(4, seed=7)
    for b in steps[:3]:
        _step(pairs, b)
    res["dp_size"] = pm.data_parallel_size
    res["pm"] = _all(_outcome(lambda: pm.generate(**gen).tolist()))
    res["ref"] = ref.generate(**gen).tolist()
    res["pm_training"], res["model_training"] = pm.training, model.training
    res["use_cache"] = model.config.use_cache  # HF's default: generate decodes with a KV cache
    gathers = []
    whole = pm.full_state_dict
    pm.full_state_dict = lambda: gathers.append(1) or whole()  # counts the gathers
    res["again"] = pm.generate(**gen).tolist()
    res["gathers_again"] = len(gathers)
    res["kept"] = "_generation" in pm.__dict__
    for m, o in pairs:  # the 4th step, its optimizer step after another generate
        o.zero_grad()
        _backward(m, steps[3])
    res["freed"] = "_generation" not in pm.__dict__  # the training forward freed the copy
    res["mid"] = pm.generate(**gen).tolist()
    res["gathers_mid"] = len(gathers)
    for _, o in pairs:
        o.step()
    res["after_step"] = pm.generate(**gen).tolist()
    res["ref_after_step"] = ref.generate(**gen).tolist()
    res["gathers_after_step"] = len(gathers)
    # an in-place write through a DTensor parameter outside a step (an EMA's habit); with
    # a pipeline only the last stage's ranks hold lm_head, and all ranks gather anyway
    for m in (pm, ref):
        held = dict(m.named_parameters())
        if "lm_head.weight" in held:
            with torch.no_grad():
                held["lm_head.weight"].mul_(-1.0)  # exact: negated twice is the same
    res["flipped"] = pm.generate(**gen).tolist()
    res["ref_flipped"] = ref.generate(**gen).tolist()
    res["gathers_flipped"] = len(gathers)
    # the user's model gone (auto_parallel(build_model(), ...)): generate builds its copy
    # from the module's structure copy (fake tensors) and the gathered weights
    if c["plan"] in ("dp", "zero3"):
        gone = weakref.ref(model)
        del model, pairs
        pm.__dict__.pop("_generation", None)
        gc.collect()
        res["model_freed"] = gone() is None
        res["without_model"] = pm.generate(**gen).tolist()
    del pm.full_state_dict
    if c["plan"] == "dp":  # an independent copy (AveragedModel's) generates with its weights
        twin = copy.deepcopy(pm)
        with torch.no_grad():
            twin.get_parameter("lm_head.weight").mul_(-1.0)
        res["twin"] = twin.generate(**gen).tolist()
        res["pm_after_twin"] = pm.generate(**gen).tolist()
    return res


def not_generative(c: dict) -> dict:
    """A model without ``generate``, and a model no longer held: every rank raises the
    same clear error."""
    torch.manual_seed(0)
    model = Three()
    x, y = _batch()
    reset()
    pm = auto_parallel(model, example_inputs=(x, y), mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                       pins={"*": "R", "input:0": "S(0)", "input:1": "S(0)"}, search="ilp")
    res = {"generate": _all(_outcome(lambda: pm.generate(x)))}
    res["forward"] = _all(_outcome(lambda: pm(x, y).item()))  # the module still works after
    gone = weakref.ref(model)
    del model  # pm holds it weakly: generate takes the module's structure copy, a Three
    gc.collect()
    res["freed"] = gone() is None
    res["gone"] = _all(_outcome(lambda: pm.generate(x)))
    return res


def run(c: dict) -> dict:
    """Dispatch ``c["fn"]``."""
    return globals()[c["fn"]](c)
