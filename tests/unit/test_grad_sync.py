"""GradSync's hot path on a one-rank gloo group (one process group for the module):
each gradient lands in its bucket once per backward and ``.grad`` becomes a view of
the bucket; accumulation with the hooks off and a flush after a backward without hooks
still reduce every gradient; the buffers serve every step unless something else holds
them.  The reductions of several ranks are tests/dist's."""

from __future__ import annotations

import datetime
import os
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime import grad_sync
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.mesh import init_mesh, release_groups, reset

# where a GPU is lent: AUTOPAR_TEST_DEVICE=cuda runs these on CUDA tensors (gloo reduces
# them too), the buffers' reuse checks included
DEVICE = torch.device(os.environ.get("AUTOPAR_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    reset()
    m = init_mesh((1,))
    yield
    dist.destroy_process_group()
    release_groups(m)
    reset()


def _model(keep: bool = True) -> tuple[nn.Module, GradSync, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(DEVICE)
    params = [(n, p, (0,)) for n, p in model.named_parameters()]
    # 64-byte buckets: the four parameters in three buckets (two launched in backward)
    return model, GradSync(params, None, bucket_bytes=64 * 4, keep=keep), torch.randn(5, 8).to(DEVICE)


def _reference(x: torch.Tensor, times: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(DEVICE)
    for _ in range(times):
        ref(x).square().sum().backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _in_bucket(sync: GradSync, p: nn.Parameter) -> bool:
    """``p.grad`` lives in its bucket's buffer (shared with the bucket's other gradients)."""
    b = next(b for b in sync.buckets if any(q is p for q in b.params))
    size = (b.offsets[-1] + b.params[-1].numel()) * 4
    ptrs = {q.grad.untyped_storage().data_ptr() for q in b.params}
    return len(ptrs) == 1 and p.grad.untyped_storage().nbytes() == size


def test_each_gradient_lands_in_its_bucket_once(monkeypatch) -> None:
    model, sync, x = _model()
    copies = []
    real = grad_sync.GradSync._fill
    monkeypatch.setattr(grad_sync.GradSync, "_fill",
                        lambda self, b, i, p: copies.append(i) or real(self, b, i, p))
    model(x).square().sum().backward()
    # one slot per parameter per backward (the launch visited every one again before)
    assert len(copies) == 4
    want = _reference(x)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n  # one rank: the sum is the gradient
        assert _in_bucket(sync, p), n


def _flushed_step(model: nn.Module, sync: GradSync, x: torch.Tensor) -> None:
    """zero_grad, a backward with the hooks off, then a flush."""
    for p in model.parameters():
        p.grad = None
    sync.enabled = False
    model(x).square().sum().backward()
    sync.flush()
    sync.enabled = True


def test_accumulation_and_flush_reduce_every_gradient() -> None:
    model, sync, x = _model()
    sync.enabled = False  # accumulation: hooks fill the buckets, nothing is reduced
    model(x).square().sum().backward()
    sync.enabled = True
    model(x).square().sum().backward()
    want = _reference(x, times=2)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want[n], rtol=1e-6, atol=0), n
    # a backward without hooks (the zero-bubble schedule's W writes .grad directly),
    # then a flush: every gradient is put in its bucket and reduced
    _flushed_step(model, sync, x)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, _reference(x)[n]), n
        assert _in_bucket(sync, p), n
    # the next such step fills the same buffers through the same views (the flush ran in
    # grad mode, which took new views as for a backward building its graph: a new
    # DTensor gradient per parameter every step)
    views = [[weakref.ref(v) for v in b.views] for b in sync.buckets]  # (a strong one would pin them)
    _flushed_step(model, sync, x)
    assert all(v is w() for b, vs in zip(sync.buckets, views) for v, w in zip(b.views, vs))


def test_a_backward_that_builds_its_graph_keeps_its_gradients() -> None:
    # backward(create_graph=True) (a gradient penalty) runs the hooks in grad mode with
    # gradients that require grad: the slots must take an in-place copy of them (views
    # made by split refuse one, "a view ... is being modified inplace")
    model, sync, x = _model()
    model(x).square().sum().backward(create_graph=True)
    want = _reference(x)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad.detach(), want[n], rtol=1e-6, atol=0), n


def _step(model: nn.Module, x: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None  # zero_grad(set_to_none=True)
    model(x).square().sum().backward()


def test_buffers_serve_every_step() -> None:
    # before: each backward took a new buffer per bucket and 69 views of it (the
    # 4-layer GPT), dropped at the end of the step; DDP keeps its buckets
    model, sync, x = _model()
    _step(model, x)
    flats = [b.flat for b in sync.buckets]
    assert all(f is not None for f in flats)
    x2 = x.flip(0) * 2
    _step(model, x2)
    assert all(b.flat is f for b, f in zip(sync.buckets, flats))
    want = _reference(x2)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n
        assert _in_bucket(sync, p), n


def test_buffers_not_kept_are_freed_with_the_gradients() -> None:
    # a plan whose memory does not allow keeping them (Decisions.grad_buffers_kept
    # False): each backward takes new buffers, held only by the gradients
    model, sync, x = _model(keep=False)
    _step(model, x)
    assert all(b.flat is None and not b.views for b in sync.buckets)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, _reference(x)[n]), n


def test_a_gradient_kept_across_zero_grad_keeps_its_values() -> None:
    # a gradient the user kept (or a view of one) across zero_grad() must not be
    # overwritten by the next backward: its bucket takes a new buffer, the others reuse
    model, sync, x = _model()
    _step(model, x)
    w0, b0, w1, b1 = model.parameters()
    kept, alias = w1.grad, b0.grad.view(-1)
    before = (kept.clone(), alias.clone())
    bucket = {id(p): b for b in sync.buckets for p in b.params}
    flats = {id(p): bucket[id(p)].flat for p in (w0, b0, w1, b1)}
    x2 = x.flip(0) * 2
    _step(model, x2)
    assert torch.equal(kept, before[0]) and torch.equal(alias, before[1])
    want = _reference(x2)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n
    held = {id(w1), id(b0)}
    for p in (w0, b0, w1, b1):
        shares = any(id(q) in held for q in bucket[id(p)].params)
        assert (bucket[id(p)].flat is flats[id(p)]) is not shares
