"""Capture a user's ``nn.Module`` into the aten-level IR.

``torch.export.export(strict=False)`` is the capture path: it handles hand-written
models and Hugging Face models alike (``fx.symbolic_trace`` fails on the control flow
of HF GPT-2 and Llama) and gives aten ops with shapes attached, which
keeps the rule registry to one op vocabulary.  ``fx.symbolic_trace`` is still tried
first as a cheap check that reports *why* a model is dynamic when export also fails.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from autopar.capture.batch_index import rows_as_slices
from autopar.capture.causal_mask import fold_causal_masks
from autopar.capture.checks import custom_function_guard, data_dependent_error
from autopar.capture.grad_regions import inline_grad_regions, mark_tables
from autopar.capture.hf_experts import experts_as_op
from autopar.capture.mixed_precision import apply_mixed_precision
from autopar.capture.scalar_reads import replicate_scalar_reads
from autopar.capture.side_views import duplicate_side_views
from autopar.capture.user_checkpoint import checkpoint_regions
from autopar.errors import AutoparWarning, CaptureError, user_stacklevel
from autopar.plans.kinds import Precision

_DROP_TARGETS = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"}


def _lazy_code() -> contextlib.AbstractContextManager:
    """Export's own passes regenerate the whole graph's Python code ~20 times (0.1 s each
    for a 32-layer Llama); as lazy graph modules they only mark it stale and the code is
    generated once, when used (about a sixth of Llama-3 8B's capture).  A private torch
    switch (used by inductor): where torch lacks it, capture regenerates the code each time."""
    try:
        # optional: a private torch module, missing from some torch versions
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # pragma: no cover - torch without it
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


@contextlib.contextmanager
def _no_stack_traces():
    """Export records the Python stack of every op it traces (``node.meta["stack_trace"]``,
    which nothing in autopar reads: a capture error names the model's line from the
    exception's own traceback): ~18% of a 32-layer Llama's capture on 2 cores (8.5 s
    against 10.4 s under the same load).  torch's own switch, put back afterwards."""
    cfg = getattr(torch.fx, "config", None)
    if cfg is None or not hasattr(cfg, "do_not_emit_stack_traces"):  # pragma: no cover - older torch
        yield
        return
    old = cfg.do_not_emit_stack_traces
    cfg.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        cfg.do_not_emit_stack_traces = old


@dataclass
class Captured:
    """A captured model: the graph module and how its names map back to the model.

    ``aliases`` maps each graph parameter/buffer target (the ``get_attr`` name) to
    every name the original ``state_dict`` uses for that tensor, so tied weights show
    up once in the graph and under all their names in :meth:`full_state_dict`.
    """

    gm: fx.GraphModule
    method: str
    seconds: float
    aliases: dict[str, list[str]] = field(default_factory=dict)
    num_inputs: int = 0
    in_spec: object = None
    out_spec: object = None
    state_keys: list[str] = field(default_factory=list)


def _strip_guards(gm: fx.GraphModule) -> None:
    """Remove export's guard call and metadata assertions: they check the inputs
    against the traced ones, which no longer holds once inputs are sharded."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op == "call_module" and n.target == "_guards_fn":
            g.erase_node(n)
        elif n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] in _DROP_TARGETS:
            g.erase_node(n)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    # export's input check (a forward pre-hook comparing the call with its in_spec): the
    # generated module is called with flat inputs, bound by ParallelModule beforehand
    for k, h in list(gm._forward_pre_hooks.items()):
        if "input_constraints" in getattr(h, "__name__", ""):
            del gm._forward_pre_hooks[k]
            gm._forward_pre_hooks_with_kwargs.pop(k, None)
    g.eliminate_dead_code()  # capture() recompiles once after all its passes


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` under every name it has: persistent or
    not (Llama's ``rotary_emb.inv_freq`` and BERT's ``position_ids`` are non-persistent
    buffers, absent from ``state_dict()``), tied weights under each of their names."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def _aliases(model: nn.Module, gm: fx.GraphModule) -> dict[str, list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, t in named_tensors(model).items():
        by_id.setdefault(id(t), []).append(name)
    out: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        try:
            t = model.get_parameter(n.target)
        except AttributeError:
            try:
                t = model.get_buffer(n.target)
            except AttributeError:
                continue  # a constant export lifted (e.g. a tensor literal)
        out[n.target] = by_id.get(id(t), [n.target])
    return out


_SIMPLE = (int, float, bool, str, type(None))
_CONTAINERS = (list, tuple, dict, set, frozenset)


def _state_view(v: object) -> object:
    """What of an attribute's value counts as its Python state: a number or string as it
    is; a container by its length and the identity of its items (``self.hist.append(x)``,
    ``self.cache[k] = h``); anything else (a tensor stashed as ``self.last = h``, an object)
    by identity.  Identity, not equality: comparing tensors with ``==`` is elementwise."""
    if isinstance(v, _SIMPLE):
        return (type(v), v)
    if isinstance(v, dict):
        return (dict, tuple((k if isinstance(k, _SIMPLE) else id(k), id(x)) for k, x in v.items()))
    if isinstance(v, (set, frozenset)):
        return (set, frozenset(id(x) for x in v))
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(id(x) for x in v))
    return (object, id(v))


def _shown(v: object) -> str:
    """``v`` in a warning, as it is when this is called (containers change in place)."""
    if isinstance(v, _SIMPLE):
        return repr(v)
    if isinstance(v, _CONTAINERS):
        return f"a {type(v).__name__} of {len(v)}"
    if isinstance(v, torch.Tensor):  # capture's fake tensors included
        return "a tensor"
    return f"a {type(v).__name__}"


def _public_state(m: nn.Module) -> dict[str, tuple[str, object]]:
    """``name -> (value as shown, state view)`` of ``m``'s public plain attributes
    (parameters, buffers and submodules live elsewhere: nn.Module's own dicts)."""
    return {k: (_shown(v), _state_view(v)) for k, v in vars(m).items() if not k.startswith("_")}


@contextlib.contextmanager
def _frozen_python_state(model: nn.Module):
    """Warn when the forward changes Python state (a call counter, a flag, a list it
    appends to, a tensor it stashes): capture runs it once and freezes that call's values
    into the graph, so later calls would not see the change.  torch.export restores the
    attributes afterwards, so the change is seen by forward hooks around each submodule's
    call."""
    changed: dict[str, tuple[object, object]] = {}
    names = {m: n for n, m in model.named_modules()}
    before: dict[nn.Module, dict] = {}

    def pre(m, *_):
        before[m] = _public_state(m)

    def post(m, *_):
        now = _public_state(m)
        old = before.pop(m, {})
        for k in sorted(set(old) | set(now)):
            a, b = old.get(k, ("unset", None)), now.get(k, ("unset", None))
            if a[1] != b[1]:
                changed.setdefault(f"{names[m]}.{k}".lstrip("."), (a[0], b[0]))

    handles = [h for m in names for h in (m.register_forward_pre_hook(pre),
                                          m.register_forward_hook(post))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    if changed:
        desc = ", ".join(f"{k} ({a} -> {b})" for k, (a, b) in list(changed.items())[:5])
        warnings.warn(f"autopar: the forward changed Python state {desc}; the plan captured one "
                      "call, so every later call computes with that call's values. Keep such "
                      "state in tensors (buffers) or outside the model.", AutoparWarning,
                      stacklevel=user_stacklevel())


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module):
    """Hugging Face models default to ``use_cache=True`` and return a ``DynamicCache``,
    which is no pytree and means nothing in training: capture with the cache off (the
    output's ``past_key_values`` is then ``None``) and restore the user's config."""
    cfgs = [m.config for m in model.modules()
            if getattr(getattr(m, "config", None), "use_cache", False) is True]
    for c in cfgs:
        c.use_cache = False
    try:
        yield
    finally:
        for c in cfgs:
            c.use_cache = True


def capture(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None = None,
            precision: Precision | str = Precision.NATIVE) -> Captured:
    """Capture ``model`` called as ``model(*example_inputs, **example_kwargs)``;
    ``precision="bf16-mixed"`` writes autocast's casts into the graph
    (:mod:`autopar.capture.mixed_precision`).

    Raises :class:`CaptureError` naming both tracers' failures when neither works.
    """
    t0 = time.perf_counter()
    gm = export_module(model, example_inputs, example_kwargs)
    finish(gm, precision)
    return captured(model, gm, time.perf_counter() - t0)


def export_module(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None = None,
                  dynamic_shapes: object = None) -> fx.GraphModule:
    """``torch.export`` (non-strict) of ``model`` called with the example inputs, as an
    unlifted graph module; ``dynamic_shapes`` as export takes it.  Raises
    :class:`CaptureError` naming both tracers' failures when neither works."""
    kwargs = example_kwargs or {}
    try:
        # the state check is outside catch_warnings: its own warning must show
        with _frozen_python_state(model), warnings.catch_warnings(), _no_kv_cache(model), \
                custom_function_guard(), experts_as_op(model), _lazy_code(), _no_stack_traces(), \
                checkpoint_regions(model):  # experts: one op per layer; the user's checkpoints marked
            warnings.simplefilter("ignore")
            ep = torch.export.export(model, tuple(example_inputs), kwargs, strict=False,
                                     dynamic_shapes=dynamic_shapes)
    except CaptureError:
        raise  # our own finding (a custom autograd.Function): already says what to do
    except Exception as export_err:  # noqa: BLE001 - reported with context below
        mine = data_dependent_error(model, export_err)
        if mine is not None:
            raise mine from export_err
        try:
            fx.symbolic_trace(model)
            fx_msg = "torch.fx.symbolic_trace succeeded but the graph needs shapes export could not give"
        except Exception as fx_err:  # noqa: BLE001
            fx_msg = f"torch.fx.symbolic_trace failed: {type(fx_err).__name__}: {str(fx_err)[:300]}"
        raise CaptureError(
            f"cannot capture {type(model).__name__}: torch.export (non-strict) failed with "
            f"{type(export_err).__name__}: {str(export_err)[:500]}; {fx_msg}. autopar needs a "
            "graph with static shapes: data-dependent control flow or shapes (e.g. routing "
            "with nonzero) cannot be planned; use fixed-capacity routing."
        ) from export_err
    with _lazy_code():
        return ep.module()


def finish(gm: fx.GraphModule, precision: Precision | str) -> None:
    """Capture's passes over an exported module, in place: grad regions inlined, guards
    dropped, autocast's casts for ``precision``, side views copied per layer, and a flat
    calling convention (``gm._in_spec``/``_out_spec`` keep the pytree specs)."""
    finish_shapeless(gm)
    finish_shaped(gm, precision)


def finish_shapeless(gm: fx.GraphModule) -> None:
    """The passes of :func:`finish` that read no shape (a graph exported with symbolic
    dims takes them before it is given numbers: :mod:`autopar.capture.any_shape`)."""
    # no_grad regions (HF rotary embeddings) as plain ops: plannable and exportable
    inline_grad_regions(gm, recompile=False)
    mark_tables(gm)
    # .item() reads the whole value on every rank, not its own shard or partial sum
    replicate_scalar_reads(gm)
    _strip_guards(gm)


def finish_shaped(gm: fx.GraphModule, precision: Precision | str) -> None:
    """The rest of :func:`finish`: the passes that evaluate masks or read shapes."""
    # a mask built from shapes alone that is only causal: SDPA's is_causal, as in eager
    fold_causal_masks(gm)
    # a padding mask's rows picked by their own numbers: a slice that splits like the batch
    rows_as_slices(gm)
    apply_mixed_precision(gm, precision, recompile=False)
    # a layer's view of a shared input (rotary tables) copied per user: the layer stays a
    # chain link for the repeated-layer solver and each user picks its own layout
    duplicate_side_views(gm, recompile=False)
    # Flat calling convention: the ParallelModule flattens inputs and unflattens
    # outputs with these specs, so the generated code is plain and exportable.
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None:
        gm._in_spec, gm._out_spec = info.in_spec, info.out_spec
    gm.graph._codegen = fx.graph.CodeGen()
    gm.recompile()


def captured(model: nn.Module, gm: fx.GraphModule, seconds: float) -> Captured:
    """The :class:`Captured` of ``model`` for its finished graph module ``gm``."""
    nin = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    return Captured(gm=gm, method="export", seconds=seconds, aliases=_aliases(model, gm),
                    num_inputs=nin, in_spec=gm._in_spec, out_spec=gm._out_spec,
                    state_keys=list(model.state_dict().keys()))
