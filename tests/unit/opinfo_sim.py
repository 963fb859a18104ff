"""Every rule against PyTorch's own op samples (the OpInfo database), values and gradients.

API:

- :func:`validate_opinfo` ``(op_names=None, meshes=MESHES, grads=True, max_samples=None)
  -> Report``: for every OpInfo (or those named; ``name`` or ``name.variant``) take its
  sample inputs at sizes that shard on 2, 4 and 2x2 ranks (:func:`even_sizes`), capture
  ``op(sample.input, *sample.args, **sample.kwargs)`` with autopar's capture, annotate,
  and check every strategy of every node with a rule on every mesh with
  :func:`rule_grad.check_strategy_grads` (forward values and gradients).
- :func:`opinfo_cases` ``(op_names=None)``: the (OpInfo, dtype, sample index, sample)
  cases that run, in a fixed order (seeded sample generation).
- :func:`validate_case` ``(case, meshes, grads, report)``: one case into ``report``.

Samples are generated in float64 (float32 where the op has no float64, else the op's
first dtype) and again in int64 and bool where the op supports them.  A sample that
export cannot capture, whose graph has no op with a rule, or whose op is random (two
runs under different seeds differ) is skipped and counted with its reason; it is not a
failure.  A strategy whose values or gradients differ is *wrong* (``AssertionError``);
one that raises anything else while planning, lowering or running is *crashed*.

Regenerate the numbers of ``docs/architecture.md``:
``OMP_NUM_THREADS=1 python tests/unit/opinfo_sim.py --out opinfo_report.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from rule_grad import check_strategy_grads, reference
from rule_sim import node_values
from torch import fx, nn
from torch.utils import _pytree as pytree

from autopar.capture.annotate import annotate
from autopar.capture.ir import tensor_inputs
from autopar.capture.trace import capture
from autopar.sharding.rules import RuleCtx, has_rule, op_strategies

MESHES: tuple[tuple[int, ...], ...] = ((2,), (4,), (2, 2))
# OpInfo's sample sizes (S=5, M=10, L=20, XS=3) shard on no mesh; these shard on 2 and 4
EVEN_SIZES = {"XS": 2, "S": 4, "M": 8, "L": 16}
EXTRA_DTYPES = (torch.int64, torch.bool)


@dataclass
class Report:
    """What a run checked and found (reproducible: seeded samples, fixed order)."""

    opinfos: set[str] = field(default_factory=set)        # OpInfos with a checked node
    targets: set[str] = field(default_factory=set)        # aten overloads checked
    samples: int = 0                                      # samples with a checked node
    strategies: int = 0                                   # (node, mesh, strategy) checks
    wrong: list[str] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)
    skipped: collections.Counter = field(default_factory=collections.Counter)
    seconds: float = 0.0

    @classmethod
    def load(cls, path: str) -> Report:
        """A report written by ``--out``."""
        with open(path) as f:
            d = json.load(f)
        return cls(set(d["opinfos"]), set(d["targets"]), d["samples"], d["strategies"],
                   d["wrong"], d["crashed"], collections.Counter(d["skipped"]), d["seconds"])

    def summary(self) -> dict:
        """A JSON-able summary (counts, and the first lines of each failure)."""
        d = asdict(self)
        d["opinfos"], d["targets"] = sorted(self.opinfos), sorted(self.targets)
        d["skipped"] = dict(sorted(self.skipped.items()))
        d["counts"] = {"opinfos": len(self.opinfos), "targets": len(self.targets),
                       "samples": self.samples, "strategies": self.strategies,
                       "wrong": len(self.wrong), "crashed": len(self.crashed),
                       "skipped": sum(self.skipped.values()), "seconds": round(self.seconds)}
        return d


def merge(reports: Sequence[Report]) -> Report:
    """One report for several runs (the shards of one run)."""
    out = Report()
    for r in reports:
        out.opinfos |= r.opinfos
        out.targets |= r.targets
        out.samples += r.samples
        out.strategies += r.strategies
        out.wrong += r.wrong
        out.crashed += r.crashed
        out.skipped.update(r.skipped)
        out.seconds = max(out.seconds, r.seconds)
    return out


@dataclass(frozen=True)
class Case:
    """One sample of one OpInfo in one dtype."""

    name: str
    dtype: torch.dtype
    index: int
    sample: object  # torch.testing._internal.opinfo.core.SampleInput
    op: object      # the OpInfo

    @property
    def label(self) -> str:
        """``add[float64 #3]``."""
        return f"{self.name}[{str(self.dtype).removeprefix('torch.')} #{self.index}]"


def _size_modules() -> list[object]:
    import torch.testing._internal.common_methods_invocations as cmi  # noqa: F401

    return [m for n, m in list(sys.modules.items())
            if n.startswith("torch.testing._internal") and m is not None
            and any(isinstance(getattr(m, k, None), int) for k in EVEN_SIZES)]


@contextlib.contextmanager
def even_sizes() -> Iterator[None]:
    """Patch OpInfo's size constants (module globals read when samples are made) to
    even sizes, in every module of torch's test suite that defines them."""
    saved = []
    for m in _size_modules():
        for k, v in EVEN_SIZES.items():
            if isinstance(getattr(m, k, None), int):
                saved.append((m, k, getattr(m, k)))
                setattr(m, k, v)
    try:
        yield
    finally:
        for m, k, v in saved:
            setattr(m, k, v)


def _full_name(op: object) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _dtypes(op: object) -> list[torch.dtype]:
    ok = op.supported_dtypes("cpu")
    main = next((d for d in (torch.float64, torch.float32) if d in ok), None)
    if main is None:
        main = min(ok, key=str) if ok else None
    return [d for d in dict.fromkeys((main, *EXTRA_DTYPES)) if d is not None and d in ok]


def opinfo_cases(op_names: Sequence[str] | None = None,
                 shard: tuple[int, int] = (0, 1)) -> Iterator[Case]:
    """The cases of every OpInfo (or of ``op_names``), in op_db order; samples are
    made under :func:`even_sizes` with the global RNG seeded per OpInfo and dtype.
    ``shard=(i, n)``: only every n-th OpInfo from the i-th (to run in n processes)."""
    from torch.testing._internal.common_methods_invocations import op_db

    wanted = set(op_names) if op_names is not None else None
    for k, op in enumerate(op_db):
        if k % shard[1] != shard[0]:
            continue
        name = _full_name(op)
        if wanted is not None and name not in wanted and op.name not in wanted:
            continue
        for dtype in _dtypes(op):
            torch.manual_seed(0)
            with even_sizes(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))
                except Exception:  # noqa: BLE001 - a sample generator that fails on cpu
                    continue
            for i, s in enumerate(samples):
                yield Case(name, dtype, i, s, op)


class _Call(nn.Module):
    """``forward(*tensors) = op(input, *args, **kwargs)`` with the sample's tensors as
    the module's inputs and everything else as constants."""

    def __init__(self, fn: object, sample: object) -> None:
        super().__init__()
        leaves, self.spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self.leaves = leaves
        self.slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.fn = fn

    def tensors(self) -> list[torch.Tensor]:
        """The sample's tensors, in the order ``forward`` takes them."""
        return [self.leaves[i] for i in self.slots]

    def forward(self, *ts: torch.Tensor) -> object:
        leaves = list(self.leaves)
        for i, t in zip(self.slots, ts):
            leaves[i] = t
        x, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.fn(x, *args, **kwargs)


class Skip(Exception):
    """A case the validator cannot check, with the reason (counted, not a failure)."""


def captured_case(case: Case) -> tuple[fx.GraphModule, dict[str, object]]:
    """The annotated graph of ``case`` and every node's value on its inputs."""
    mod = _Call(case.op.op, case.sample)
    xs = [t.detach().clone() for t in mod.tensors()]
    try:
        gm = annotate(capture(mod, tuple(xs)).gm)
    except Exception as e:  # noqa: BLE001 - export's failures are many and not ours
        raise Skip(f"capture failed: {type(e).__name__}") from e
    if not any(n.op == "call_function" and has_rule(n.target) for n in gm.graph.nodes):
        raise Skip("no op with a rule in its graph")
    try:
        env = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            env.append(node_values(gm, xs))
    except Exception as e:  # noqa: BLE001 - the captured graph does not rerun
        raise Skip(f"captured graph does not run: {type(e).__name__}") from e
    if not _same(env[0], env[1]):
        raise Skip("random op (values depend on the seed)")
    return gm, env[0]


def _same(a: dict, b: dict) -> bool:
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor):
            if v.shape != w.shape or not torch.equal(torch.nan_to_num(v), torch.nan_to_num(w)):
                return False
    return True


def _random(node: fx.Node, inputs: list) -> bool:
    """A seeded random op (torch's tag) that draws here (dropout with p > 0 in
    training): the sharded form draws its own mask, which no reference can match."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        outs.append(reference(node, inputs).outs)
    return any(isinstance(a, torch.Tensor) and not torch.equal(a, b) for a, b in zip(*outs))


def _shape_only(node: fx.Node) -> bool:
    return "empty" in str(node.target)


def validate_case(case: Case, meshes: Sequence[tuple[int, ...]], grads: bool,
                  report: Report) -> None:
    """Check every strategy of every node with a rule in ``case`` on ``meshes``."""
    try:
        gm, env = captured_case(case)
    except Skip as e:
        report.skipped[str(e)] += 1
        return
    report.samples += 1
    report.opinfos.add(case.name)
    for node in gm.graph.nodes:
        if node.op != "call_function" or not has_rule(node.target):
            continue
        inputs = [env[x.name] for x in tensor_inputs(node)]
        if _random(node, inputs):
            report.skipped["random op (values depend on the seed)"] += 1
            continue
        report.targets.add(str(node.target))
        for mesh in meshes:
            _validate_node(case, node, mesh, inputs, grads, report)


def _validate_node(case: Case, node: fx.Node, mesh: tuple[int, ...], inputs: list,
                   grads: bool, report: Report) -> None:
    where = f"{case.label} {node.target} on mesh {mesh}"
    try:
        strategies = op_strategies(node, RuleCtx(mesh))
        ref = reference(node, inputs) if strategies else None
    except Exception as e:  # noqa: BLE001 - a rule that cannot plan this node
        report.crashed.append(f"{where}: planning: {type(e).__name__}: {str(e)[:300]}")
        return
    for i, s in enumerate(strategies):
        report.strategies += 1
        try:
            check_strategy_grads(node, s, mesh, inputs, seed=i, grads=grads,
                                 shape_only=_shape_only(node), ref=ref)
        except AssertionError as e:
            report.wrong.append(f"{case.label}: {str(e)[:400]}")
        except Exception as e:  # noqa: BLE001 - counted as a crash, with its message
            report.crashed.append(f"{case.label}: {type(e).__name__}: {str(e)[:400]}")


def validate_opinfo(op_names: Sequence[str] | None = None,
                    meshes: Sequence[tuple[int, ...]] = MESHES, grads: bool = True,
                    max_samples: int | None = None, verbose: bool = False,
                    shard: tuple[int, int] = (0, 1)) -> Report:
    """Validate the rules on the OpInfo samples (see the module docstring);
    ``max_samples`` caps the samples taken per OpInfo and dtype; ``verbose`` prints
    each OpInfo's running counts to stderr as it starts."""
    report = Report()
    t0 = time.perf_counter()
    last = None
    for case in opinfo_cases(op_names, shard):
        if max_samples is not None and case.index >= max_samples:
            continue
        if verbose and case.name != last:
            last = case.name
            print(f"{time.perf_counter() - t0:7.0f}s {case.name}: {report.strategies} checked, "
                  f"{len(report.wrong)} wrong, {len(report.crashed)} crashed",
                  file=sys.stderr, flush=True)
        w0, c0 = len(report.wrong), len(report.crashed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate_case(case, meshes, grads, report)
        if verbose:
            for line in [*report.wrong[w0:], *report.crashed[c0:]]:
                print("   ", line.splitlines()[0][:300], file=sys.stderr, flush=True)
    report.seconds = time.perf_counter() - t0
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the validation, print the counts, write the full report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="*", help="OpInfo names (default: all)")
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--no-grads", action="store_true")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--shard", default="0/1", help="i/n: every n-th OpInfo from the i-th")
    ap.add_argument("--merge", nargs="*", help="merge these JSON reports instead of running")
    a = ap.parse_args(argv)
    if a.merge:
        rep = merge([Report.load(p) for p in a.merge])
    else:
        i, n = map(int, a.shard.split("/"))
        rep = validate_opinfo(a.ops or None, grads=not a.no_grads, max_samples=a.max_samples,
                              verbose=a.verbose, shard=(i, n))
    s = rep.summary()
    print(json.dumps(s["counts"]))
    for line in [*rep.wrong[:20], *rep.crashed[:20]]:
        print(line.splitlines()[0])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(s, f, indent=1)
    return 0 if not rep.wrong and not rep.crashed else 1


if __name__ == "__main__":
    sys.exit(main())
