"""One plan, many shapes (issue 65), on real gloo ranks; run by test_any_shape.py.

A tiny Hugging Face Llama is planned at batch 4 x 16 tokens and trained by an ordinary
loop (``pm(**batch)``, ``loss.backward()``, AdamW) on batches of other shapes: shorter and
longer sequences, a global batch that does not divide by the data-parallel degree,
fine-tuning batches padded to their own longest sequence (``attention_mask`` and labels
of -100 on the padding); then evaluated under ``torch.no_grad()`` at batch 1.  The same
loop on the unmodified model in one process is the reference.  Every rank returns what
it saw; the test compares.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from autopar import MeshSpec, auto_parallel
from autopar.runtime.mesh import reset

VOCAB = 128


def _model():
    import transformers as tf
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    return tf.LlamaForCausalLM(cfg)


def padded(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Sequences of ``lengths`` padded on the right to the longest (what
    ``DataCollatorWithPadding`` gives): ``attention_mask`` 0 and labels -100 there."""
    g = torch.Generator().manual_seed(seed)
    n, s = len(lengths), max(lengths)
    ids = torch.randint(1, VOCAB, (n, s), generator=g)
    mask = torch.zeros(n, s, dtype=torch.long)
    for i, k in enumerate(lengths):
        mask[i, :k] = 1
    ids = ids * mask  # pad id 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


PLANS = {"dp": {}, "zero3": {"zero_stage": 3}, "pp": {"pipeline_stages": 2, "micro_batches": 2},
         "accumulate": {"micro_batches": 2, "pipeline_stages": 1},
         # the search picks zero-bubble for "pp", whose split backward runs eagerly
         "pp-1f1b": {"pipeline_stages": 2, "micro_batches": 2, "schedule": "1f1b"},
         "copies": {"copies": 2},
         "cp": {"context_parallel": "exchange"}}


def build(c: dict, model, example: dict):
    """The case's ParallelModule of ``model`` planned at ``example``."""
    import hf_zoo

    mesh = tuple(c["mesh"])
    pins = hf_zoo.tp_pins("llama", mesh) if c["plan"] == "tp" else {}
    if c["plan"] in ("ddp", "copies"):  # data parallel as DDP runs it: weights whole, rows split
        pins = {"*": "R" * len(mesh), **{f"input:{i}": "S(0)" * len(mesh) for i in range(3)}}
    if c["plan"] == "gathered":  # data parallel, one batch input gathered: the ranks' shapes must agree
        pins = {"*": "R" * len(mesh), "input:0": "S(0)" * len(mesh), "input:1": "S(0)" * len(mesh),
                "input:2": "R" * len(mesh)}
    if c["plan"] == "cp":  # the sequence split over the last axis, the batch over the others
        data = "".join("S(1)" if a == len(mesh) - 1 else "S(0)" for a in range(len(mesh)))
        pins = {"*": "R" * len(mesh), **{f"input:{i}": data for i in range(3)}}
    opts = {**PLANS.get(c["plan"], {}), **({"pack": True} if c.get("autopack") else {})}
    reset()
    return auto_parallel(model, example_kwargs=example, mesh=MeshSpec.preset("cpu-gloo", shape=mesh),
                         pins=pins, search="ilp", batch=c.get("batch", "global"), **opts)


def _rows(batch: dict, lo: int, hi: int) -> dict:
    return {k: v[lo:hi] for k, v in batch.items()}


def _items(c: dict, batch: dict) -> dict:
    """``batch`` with ``num_items_in_batch`` (its count of real target tokens, as the
    Hugging Face Trainer passes it) where case ``c`` asks for it."""
    if not c.get("items"):
        return batch
    return {**batch, "num_items_in_batch": (batch["labels"][:, 1:] != -100).sum()}


def _step(pm, opt, mine: dict, ref, ropt, batch: dict, res: dict) -> None:
    """One AdamW step of ``pm`` on this rank's ``mine`` and of ``ref`` on the global
    ``batch``; their losses appended to ``res``."""
    opt.zero_grad()
    if pm.runner is not None or pm.plan.decisions.copies > 1:  # the loss alone
        loss = pm.train_step(**mine)
    else:
        loss = pm(**mine).loss
        loss.backward()
    opt.step()
    ropt.zero_grad()
    rout = ref(**batch)
    rout.loss.backward()
    ropt.step()
    res["loss"].append(float(loss))
    res["ref"].append(float(rout.loss))


def _weights_gap(pm, ref) -> float:
    """The largest difference between ``pm``'s whole weights and ``ref``'s."""
    full = pm.full_state_dict()
    rstate = ref.state_dict()
    return max((full[k].float() - rstate[k].float()).abs().max().item() for k in full if k in rstate)


def _built(pm) -> dict:
    """How ``pm`` served its new shapes: graphs built, captures exported and given by
    the symbolic export, and the template families they run as."""
    return {"built": pm.routes.built, "exported": pm.routes.captures.exported,
            "given": pm.routes.captures.instantiated, "families": len(pm.routes.templates.families)}


def train_shapes(c: dict) -> dict:
    """Train on batches of every shape in ``c["steps"]`` (lists of lengths, global
    batches) and evaluate at batch 1; losses, weights and eval logits against the
    single process.  Under ``batch="local"`` each data-parallel rank passes its part of
    each global batch: ``c["split"]`` rows to each (uneven splits allowed)."""
    model = _model()
    ref = copy.deepcopy(model)
    pm = build(c, model, _items(c, padded([16] * 4, seed=0)))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    res: dict = {"loss": [], "ref": [], "built": 0}
    for i, lengths in enumerate(c["steps"]):
        batch = _items(c, padded(lengths, seed=10 + i))
        mine = batch
        if "rank_rows" in c:  # each rank its first rows (a pipeline's ranks share one dp rank)
            mine = _rows(batch, 0, c["rank_rows"][i][dist.get_rank()])
        elif c.get("batch") == "local":
            cuts = c["split"][i]
            r = pm.data_parallel_rank
            lo = sum(cuts[:r])
            mine = _rows(batch, lo, lo + cuts[r])
            mine = {k: v[:, :max(1, int(mine["attention_mask"].sum(1).max()))] if c.get("trim") else v
                    for k, v in mine.items()}
        if i == 1 and c.get("left") == dist.get_rank():  # this rank's collator pads on the left
            mine = {**mine, "attention_mask": mine["attention_mask"].flip(1)}
        _step(pm, opt, mine, ref, ropt, batch, res)
    res["weights"] = _weights_gap(pm, ref)
    pm.eval()
    ref.eval()
    with torch.no_grad():
        if c.get("autopack") and pm.runner is None and pm.plan.decisions.copies == 1:  # padded: its real tokens' logits, zeros at padding
            one = padded([9, 4, 6], seed=99)
            real = one["attention_mask"].bool()
            out = pm(**one).logits
            res["eval"] = (out - ref(**one).logits)[real].abs().max().item()
            res["padding"] = out[~real].abs().max().item()
        elif pm.runner is None and pm.plan.decisions.copies == 1:
            one = padded([9], seed=99)
            res["eval"] = (pm(**one).logits - ref(**one).logits).abs().max().item()
        elif pm.runner is not None and c.get("batch") != "local":
            # a schedule evaluates its forwards alone: the loss (logits stay on the
            # last stage), of a padded batch its micro-batches weighted by their tokens
            four = _items(c, padded([9, 5, 9, 3], seed=99))
            out = pm(**four)
            res["eval"] = abs(float(out.loss) - float(ref(**four).loss)) / float(ref(**four).loss)
            res["eval_logits"] = out.logits is None
    res["micro"] = [r.runner.micro_batches for r in pm.routes.cache.values() if r.runner is not None]
    res["rank"] = dist.get_rank()
    return {**res, **_built(pm)}


def _dp_rows(pm, batch: dict) -> dict:
    """This data-parallel rank's rows of ``batch`` (split as evenly as they go)."""
    n, dp, r = batch["input_ids"].shape[0], pm.data_parallel_size, pm.data_parallel_rank
    lo, hi = r * n // dp, (r + 1) * n // dp
    return _rows(batch, lo, hi)


def train_packed(c: dict) -> dict:
    """Under ``batch="local"`` each data-parallel rank packs its rows of every global
    batch of ``c["steps"]`` into one row (``hf_zoo.pack``: no padding, a length of its own
    every step); the single process trains on the padded global batch, the same
    sequences.  Losses, weights and an evaluation of one packed row against it."""
    from hf_zoo import pack

    model = _model()
    ref = copy.deepcopy(model)
    example = {k: torch.cat([v] * math.prod(c["mesh"])) for k, v in pack(padded([16, 16], seed=0)).items()}
    pm = build(c, model, example)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    res: dict = {"loss": [], "ref": [], "lengths": []}
    for i, lengths in enumerate(c["steps"]):
        batch = padded(lengths, seed=10 + i)
        mine = pack(_dp_rows(pm, batch))
        _step(pm, opt, mine, ref, ropt, batch, res)
        res["lengths"].append(mine["input_ids"].shape[1])
    res["weights"] = _weights_gap(pm, ref)
    pm.eval()
    ref.eval()
    with torch.no_grad():
        one = padded([9, 4], seed=99)
        out = pm(**pack(one)).logits[0]
        want = ref(**one).logits[one["attention_mask"].bool()]
        res["eval"] = (out - want).abs().max().item()
    return {**res, **_built(pm)}


def export_packed(c: dict) -> dict:
    """A ``pack=True`` module exported and loaded (``autopar.load``): the loaded one
    packs too, its loss and logits the live module's on a batch that packs to the
    planned shape (a loaded export serves that shape only: it has no model to capture)."""
    import autopar

    model = _model()
    pm = build(c, model, padded([16] * 4, seed=0))
    pm.export(c["dir"])
    loaded = autopar.load(c["dir"])
    batch = padded([16, 16, 16, 9], seed=5)  # packs to 2 rows of 32 (16 + 16; 16 + 9 + a tail)
    pm.eval()
    loaded.eval()
    with torch.no_grad():
        a, b = pm(**batch), loaded(**batch)
    real = batch["attention_mask"].bool()
    return {"loss": abs(float(a.loss) - float(b.loss)), "logits": (a.logits - b.logits).abs().max().item(),
            "padding": b.logits[~real].abs().max().item(), "pack_rows": loaded.pack_rows}


def run(c: dict) -> dict:
    """Every rank runs case ``c``; rank 0's dict goes back (with every rank's losses)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        fn = (compile_lengths if c.get("compile") else train_packed if c.get("pack")
              else export_packed if c.get("dir") else train_shapes)
        res = {"ok": True, **fn(c)}
    except Exception as e:  # noqa: BLE001 - the test asserts on the error every rank saw
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, res)
    return {"ranks": every}


def compile_lengths(c: dict) -> dict:
    """``compile=True`` trained on ``c["n"]`` batches of random lengths: the loss of
    every step against the single process, and how many times dynamo compiled."""
    import random

    import torch._dynamo

    torch._dynamo.reset()
    model = _model()
    ref = copy.deepcopy(model)
    import hf_zoo

    mesh = tuple(c["mesh"])
    reset()
    pm = auto_parallel(model, example_kwargs=padded([16] * 4, seed=0),
                       mesh=MeshSpec.preset("cpu-gloo", shape=mesh), search="ilp", compile=True,
                       pins=hf_zoo.tp_pins("llama", mesh) if c["plan"] == "tp" else {},
                       **PLANS.get(c["plan"], {}), **({"pack": True} if c.get("autopack") else {}))
    opt = torch.optim.SGD(pm.parameters(), lr=1e-2)
    ropt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    rng = random.Random(5)
    res: dict = {"loss": [], "ref": [], "lengths": []}
    longest = rng.sample([k for k in range(4, 100) if k != 16], c["n"])  # all new lengths
    for i in range(c["n"]):
        lengths = [longest[i]] + [rng.randint(1, longest[i]) for _ in range(3)]
        batch = padded(lengths, seed=200 + i)
        for module, o, key in ((pm, opt, "loss"), (ref, ropt, "ref")):
            o.zero_grad()
            if module is pm and pm.runner is not None:
                loss = pm.train_step(**batch)
            else:
                loss = module(**batch).loss
                loss.backward()
            o.step()
            res[key].append(float(loss))
        res["lengths"].append(max(lengths))
        res.setdefault("graphs", []).append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    res["templates"] = pm.routes.templates.compilations
    res["compiled"] = pm.compiled
    return {**res, **_built(pm)}
