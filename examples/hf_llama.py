"""Train a Hugging Face Llama (GQA) with autopar in an ordinary PyTorch loop.

    torchrun --nproc-per-node 2 examples/hf_llama.py --steps 6 --ckpt /tmp/llama_ckpt
    torchrun --nproc-per-node 2 examples/hf_llama.py --steps 9 --ckpt /tmp/llama_ckpt  # resumes

The model is ``LlamaForCausalLM`` as it is (a tiny config built in code, no download),
called as ``model(**batch)``.  The loop is the usual one: ``DistributedSampler`` fed by
``pm.data_parallel_rank`` / ``pm.data_parallel_size`` (``batch="local"``: each rank
loads only its part), AdamW, a warm-up + cosine LR schedule, ``clip_grad_norm_``, and a
``torch.distributed.checkpoint`` checkpoint every ``--every`` steps that a second run
resumes from (model, optimizer, scheduler and step), on as many ranks as it finds: the
global batch stays, each data-parallel rank's share follows the new world.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 128,
          batch: int = 8, seq: int = 16, meta: bool = False, ffn: int | None = None):
    """Factory for ``autopar plan examples/hf_llama.py:build``: a ``LlamaForCausalLM``
    (GQA) of the given size, no positional inputs, and a keyword batch
    ``{"input_ids", "labels"}``.  ``meta=True`` builds it on the meta device, so sizes
    far beyond this machine's memory plan without allocating weights; ``ffn``: the MLP's
    width (default 2.75 x ``hidden``; Llama-3 8B's is 14336)."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn or int(hidden * 2.75),
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max(64, seq))
    with torch.device("meta" if meta else "cpu"):
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(cfg)
        ids = torch.randint(0, vocab, (batch, seq))
    return model, (), {"input_ids": ids, "labels": ids}


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the losses of the steps run (rank 0 prints them)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="train until this global step")
    ap.add_argument("--batch", type=int, default=8, help="global batch (samples per step)")
    ap.add_argument("--every", type=int, default=3, help="checkpoint every N steps")
    ap.add_argument("--ckpt", default="/tmp/autopar_llama_ckpt", help="checkpoint directory")
    ap.add_argument("--mesh", default=None, help="mesh shape, e.g. 2 or 2x2 (default: the world)")
    args = ap.parse_args(argv)

    import hf_zoo

    import autopar

    model, example = hf_zoo.build("llama", batch=args.batch)
    torch.manual_seed(0)
    # a toy corpus a model can learn: rows count up from a random start (mod the vocab)
    data = (torch.randint(0, 128, (args.batch * 16, 1)) + torch.arange(16)) % 128
    pm = autopar.auto_parallel(model, example_kwargs=example, mesh=args.mesh, batch="local")

    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3, weight_decay=0.01)
    warmup, total = 2, max(args.steps, 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    ckpt = Path(args.ckpt)
    # resume from the last checkpoint, whatever plan and world saved it (None: none yet)
    saved = autopar.load_checkpoint(pm, opt, ckpt, scheduler=sched)
    step = saved["step"] if saved else 0

    sampler = DistributedSampler(TensorDataset(data), num_replicas=pm.data_parallel_size,
                                 rank=pm.data_parallel_rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(TensorDataset(data), batch_size=args.batch // pm.data_parallel_size,
                        sampler=sampler, drop_last=True)
    losses: list[float] = []
    pm.train()
    while step < args.steps:
        sampler.set_epoch(step // len(loader))
        done = step % len(loader)  # batches of this epoch a resumed run already trained on
        for i, (ids,) in enumerate(loader):
            if step >= args.steps:
                break
            if i < done:
                continue
            opt.zero_grad()
            if pm.runner is not None:  # micro-batched plans interleave forward and backward
                loss = pm.train_step(input_ids=ids, labels=ids)
            else:
                loss = pm(input_ids=ids, labels=ids).loss
                loss.backward()
            norm = pm.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            if pm.rank == 0:
                print(f"step {step}: loss {loss.item():.4f}  grad-norm {float(norm):.3f}  "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)
            if step % args.every == 0:
                autopar.save_checkpoint(pm, opt, ckpt, scheduler=sched, step=step)
    pm.eval()
    with torch.no_grad():
        ids = data[: args.batch // pm.data_parallel_size]
        val = pm(input_ids=ids, labels=ids).loss.item() if pm.runner is None else float("nan")
    if pm.rank == 0:
        print(f"eval loss {val:.4f}; layout:\n{pm.plan.decisions}", flush=True)
    pm.shutdown()
    return losses


if __name__ == "__main__":
    main()
