"""Variable-length fine-tuning: one plan for every length, against padding to the
maximum and against DDP.

    python benchmarks/variable_length.py [--batches 32] [--rows 8] [--world 4]

A Hugging Face Llama from a small config (2 layers, hidden 256, 4 heads, vocab 1024) trains with
AdamW on ``--world`` gloo ranks of this machine (one thread each).  Sequence lengths
come from a seeded log-normal (median 64 tokens, 512 three standard deviations above it,
clipped to 8..512); ``--rows`` of them
make a global batch, batches in random order, each padded on the right to its own
longest sequence (``attention_mask`` 0 and labels -100 on the padding: what
``DataCollatorWithPadding`` gives).  Every data-parallel rank passes its rows of each
batch (``batch="local"``, as a ``DistributedSampler`` gives them).  Seven arms train
copies of the same weights on the same batches, their steps interleaved (the order
turned every step), each step timed as the slowest rank's:

* ``autopar``: ``auto_parallel(model, batch="local")`` planned at one batch of the
  median length, fed every batch as it is;
* ``autopar-pack``: the same with ``pack=True``, fed the same batches: autopar drops
  the padding itself and runs each rank's sequences packed into one row
  (:mod:`autopar.runtime.packing`);
* ``padded``: the same planned at 512 tokens, fed every batch padded to 512 (what a
  plan for one shape asked of its user);
* ``ddp``: ``DistributedDataParallel``, its loss over the global batch's real tokens
  (``num_items_in_batch``: the per-rank sums over all ranks' tokens, as the Trainer does),
  so all the arms optimise the same loss;
* ``ddp-padded``: the same fed every batch padded to 512: what padding costs where
  nothing but the padding differs, the most the ``padded`` / ``autopar`` ratio can be on
  this host while autopar's step is DDP's;
* ``packed``: padding-free, what an FSDP2 user fine-tunes with: each rank's rows of every
  batch packed into one row by Hugging Face's ``DataCollatorWithFlattening`` (the
  sequences back to back, ``position_ids`` restarting at each: the same sequences and the
  same loss, no padding), ``auto_parallel(model, batch="local")`` planned data parallel
  (the packs' lengths differ across ranks) at one pack of median sequences;
* ``ddp-packed``: DDP fed the same packs.

autopar builds each new length's graph once (its first epoch: two lengths exported, the
rest given by the symbolic export the second one makes); a first pass over the batches,
untimed, pays that (the ``packed`` arm's too), and is reported on its own.  Prints tokens per second
(real tokens, not padding) per arm, the ratios, the first pass's seconds, and the
largest difference between the arms' losses.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from hf_zoo import pack  # noqa: E402 - examples/ is on the path from here

MAX = 512
VOCAB = 1024


SIGMA = math.log(MAX / 64) / 3
"""The log-normal's spread: the maximum, 512, three standard deviations above the median."""


def lengths(n: int, seed: int = 0) -> list[int]:
    """``n`` sequence lengths: log-normal, median 64, clipped to 8..512."""
    rng = random.Random(seed)
    return [min(MAX, max(8, round(math.exp(rng.gauss(math.log(64), SIGMA))))) for _ in range(n)]


def batches(count: int, rows: int, seed: int = 0) -> list[dict]:
    """``count`` global batches of ``rows`` sequences, each padded to its longest."""
    lens = lengths(count * rows, seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(count):
        mine = lens[b * rows:(b + 1) * rows]
        s = max(mine)
        mask = torch.zeros(rows, s, dtype=torch.long)
        for i, k in enumerate(mine):
            mask[i, :k] = 1
        ids = torch.randint(1, VOCAB, (rows, s), generator=g) * mask
        out.append({"input_ids": ids, "attention_mask": mask,
                    "labels": ids.masked_fill(mask == 0, -100)})
    random.Random(seed + 1).shuffle(out)
    return out


def pad_to(batch: dict, s: int) -> dict:
    """``batch`` padded on the right to ``s`` tokens (masked, labels -100)."""
    extra = s - batch["input_ids"].shape[1]
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {k: torch.nn.functional.pad(v, (0, extra), value=fill[k]) for k, v in batch.items()}


def model():
    import transformers as tf
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=MAX)
    return tf.LlamaForCausalLM(cfg)


def _rows(batch: dict, rank: int, world: int) -> dict:
    """This rank's rows of ``batch``."""
    n = batch["input_ids"].shape[0] // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def _tokens(batch: dict) -> int:
    """Real tokens a step trains on (the shifted labels that are not -100)."""
    return int((batch["labels"][:, 1:] != -100).sum())


FIRST = ("autopar", "autopar-pack", "packed")
"""The arms that build a graph per new length (their first pass is reported)."""

DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)", "input:2": "S(0)"}
"""``--dp``: data parallel pinned, DDP's layout (weights whole, rows split)."""


def _arms(rank: int, world: int, rows: int, pins: dict):
    """The seven modules and their optimizers, from the same weights."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autopar import MeshSpec, auto_parallel

    base = model()
    # a user's default: no mesh described, planned on the job's live calibration
    # (--preset: the cpu-gloo preset's numbers instead)
    mesh = MeshSpec.preset("cpu-gloo", shape=(world,)) if os.environ.get("AUTOPAR_CALIBRATE") == "0" else None
    # planned at a batch of the median length (the first batch's sequences cut or padded to 64)
    first = batches(1, rows, seed=99)[0]
    median = {k: v[:, :64] for k, v in pad_to(first, max(64, first["input_ids"].shape[1])).items()}
    auto = auto_parallel(copy.deepcopy(base), example_kwargs=median, mesh=mesh, batch="local",
                         pins=pins)
    padded = auto_parallel(copy.deepcopy(base), example_kwargs=pad_to(median, MAX), mesh=mesh,
                           batch="local", pins=pins)
    # one pack of this rank's share of median sequences per rank
    packs = {k: torch.cat([v] * world) for k, v in pack(_rows(median, 0, world)).items()}
    # data parallel: the ranks' packs differ in length, which a plan whose activations
    # meet across ranks would refuse (autopar-pack pads to the widest there itself)
    packed = auto_parallel(copy.deepcopy(base), example_kwargs=packs, mesh=mesh, batch="local",
                           pins=DP)
    autopack = auto_parallel(copy.deepcopy(base), example_kwargs=median, mesh=mesh, batch="local",
                             pins=pins, pack=True)
    return {name: (m, torch.optim.AdamW(m.parameters(), lr=1e-4))
            for name, m in (("autopar", auto), ("autopar-pack", autopack), ("padded", padded), ("ddp", DDP(copy.deepcopy(base))),
                            ("ddp-padded", DDP(copy.deepcopy(base))), ("packed", packed),
                            ("ddp-packed", DDP(copy.deepcopy(base))))}


def _step(name: str, m, opt, batch: dict, rank: int, world: int) -> float:
    mine = _rows(batch, rank, world)
    if name.endswith("padded"):
        mine = pad_to(mine, MAX)
    elif name.endswith("packed"):
        mine = pack(mine)
    opt.zero_grad()
    if name.startswith("ddp"):  # sum over this rank's tokens / all ranks' tokens, times world (DDP averages)
        n = _tokens(batch)
        # use_cache=False: in training Hugging Face otherwise builds a cache and then skips
        # the packed-sequence mask (the packs' sequences would see each other); autopar
        # captures without a cache
        loss = m(**mine, num_items_in_batch=torch.tensor(n / world), use_cache=False).loss
        loss.backward()
        shown = loss.detach() / world
        dist.all_reduce(shown)
    else:
        shown = m(**mine).loss
        shown.backward()
    opt.step()
    return float(shown)


def _worker(rank: int, world: int, port: int, params: dict, out: str) -> None:
    from _ranks import finish, join, timed

    join(rank, world, port)
    data = batches(params["batches"], params["rows"])
    arms = _arms(rank, world, params["rows"], DP if params["dp"] else {})
    t0 = time.perf_counter()
    for b in data:  # autopar's first pass: each new length captured and lowered once
        m, opt = arms["autopar"]
        _step("autopar", m, opt, b, rank, world)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in data:  # and the packed arms': a length of its own every step
        _step("packed", *arms["packed"], b, rank, world)
    first_packed = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in data:
        _step("autopar-pack", *arms["autopar-pack"], b, rank, world)
    first_pack = time.perf_counter() - t0
    for name in ("padded", "ddp", "ddp-padded", "ddp-packed"):  # the same updates: the arms stay in step
        for b in data:
            _step(name, *arms[name], b, rank, world)
    names = list(arms)
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    for i, b in enumerate(data):
        order = names[i % len(names):] + names[:i % len(names)]
        for n in order:
            loss = []
            times[n].append(timed(lambda n=n, b=b, loss=loss: loss.append(_step(n, *arms[n], b, rank, world))))
            losses[n].append(loss[0])
    tokens = sum(_tokens(b) for b in data)
    rows = [{"arm": n, "tokens_per_s": tokens / sum(times[n]), "median_step": statistics.median(times[n]),
             "first_pass_s": {"autopar": first, "packed": first_packed, "autopar-pack": first_pack}.get(n),
             "built": arms[n][0].routes.built if n in FIRST else None,
             "exported": arms[n][0].routes.captures.exported if n in FIRST else None,
             "layout": next((line.split(None, 1)[1] for line in arms["autopar"][0].plan.summary().splitlines()
                             if line.strip().startswith("layout")), ""),
             "ratio": statistics.median(a / b for a, b in zip(times[n], times["autopar"])),
             "loss_gap": max(abs(a - b) / abs(b) for a, b in zip(losses[n], losses["ddp"]))}
            for n in names]
    finish(rank, rows, out)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the arms and print the table."""
    from _ranks import spawn_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--rows", type=int, default=8, help="sequences per global batch")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--dp", action="store_true", help="pin data parallel (DP) instead of the plan's choice")
    ap.add_argument("--preset", action="store_true",
                    help="plan on the cpu-gloo preset instead of the live calibration")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.preset:
        os.environ["AUTOPAR_CALIBRATE"] = "0"
    else:  # measured once, in a fresh cache directory
        import tempfile
        os.environ.pop("AUTOPAR_CALIBRATE", None)
        os.environ["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-cache-")
    rows, load = spawn_rows(_worker, a.world, {"batches": a.batches, "rows": a.rows, "dp": a.dp})
    by = {r["arm"]: r for r in rows}
    print(f"{a.world} gloo ranks, {a.batches} batches of {a.rows} sequences "
          f"(lengths: log-normal, median 64, max {MAX}); load {load[0]:.1f} -> {load[1]:.1f}")
    print("| arm | tokens/s | median step (s) | step / autopar's (median of the batches) | loss vs ddp (rel) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arm']} | {r['tokens_per_s']:.0f} | {r['median_step']:.3f} | "
              f"{r['ratio']:.2f} | {r['loss_gap']:.1e} |")
    print(f"layout: {by['autopar']['layout']}")
    for n in FIRST:
        a = by[n]
        print(f"{n}'s first pass: {a['first_pass_s']:.1f} s, {a['built']} new lengths lowered, "
              f"{a['exported']} of them exported (the rest given by the symbolic export)")
    pk = {n: by[n]["tokens_per_s"] / by["padded"]["tokens_per_s"] for n in FIRST}
    print("tokens/s over the padded run's: " + ", ".join(f"{n} {v:.2f}x" for n, v in pk.items())
          + f"; autopar-pack over ddp's: {by['autopar-pack']['tokens_per_s'] / by['ddp']['tokens_per_s']:.2f}x")
    return rows


if __name__ == "__main__":
    main()
