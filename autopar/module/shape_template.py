"""One compiled graph for many shapes: the lowerings of a plan at different shapes as one
template whose shape numbers are inputs.

Every shape a module serves is lowered from the model captured at that shape
(:mod:`autopar.module.shapes`): the graphs have the same ops in the same order, and
differ only in the numbers their ops take (a ``view``'s sizes, an ``arange``'s end).
Keeping a graph per shape would cost a graph's memory per length, and under
``torch.compile`` a compilation per length.  :class:`Templates` instead keeps, per
family of graphs with the same ops (:func:`signature`), the first graph with the numbers
that differ between the family's graphs turned into inputs, and each shape as the
numbers where it differs from the first (:class:`Shape`).  A call runs the template with
its shape's numbers: the same ops on the same numbers as that shape's own graph.
Compiled, dynamo compiles a template once with the numbers fixed, and once more with
them symbolic when they first change (its automatic dynamic shapes); a shape whose
numbers differ where no earlier one did widens the template (one more compilation).
So a training loop over any number of lengths compiles a few times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

from autopar.capture.graph_numbers import NUMBER, numbers, signature
from autopar.passes.train_mode import set_train_mode
from autopar.runtime.compile_fallback import CompiledOrEager


def template(gm: fx.GraphModule, varying: set[int]) -> fx.GraphModule:
    """A copy of ``gm`` whose numbers at positions ``varying`` (of :func:`numbers`) are
    inputs after the graph's own, in position order."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    nodes = list(gm.graph.nodes)
    last_ph = None
    for n in nodes:
        if n.op == "placeholder":
            env[n] = last_ph = g.node_copy(n, env.__getitem__)
    slots: dict[int, fx.Node] = {}
    for i in sorted(varying):
        if last_ph is not None:
            with g.inserting_after(last_ph):
                last_ph = slots[i] = g.placeholder(f"shape_{i}")
        else:
            last_ph = slots[i] = g.placeholder(f"shape_{i}")
    count = [0]

    def sub(a: object) -> object:
        if isinstance(a, bool) or a is None:
            return a
        if isinstance(a, NUMBER):
            i = count[0]
            count[0] += 1
            return slots.get(i, a)
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, (tuple, list)):
            return type(a)(sub(x) for x in a)
        if isinstance(a, dict):
            return {k: sub(v) for k, v in a.items()}
        return a

    for n in nodes:
        if n.op == "placeholder":
            continue
        if n.op in ("call_function", "call_method", "call_module"):
            new = g.create_node(n.op, n.target, sub(n.args), sub(n.kwargs), n.name)
            new.meta = dict(n.meta)
        else:
            new = g.node_copy(n, env.__getitem__)
        env[n] = new
    return fx.GraphModule(gm, g)


@dataclass
class Family:
    """Lowerings with the same ops (one :func:`signature`): the first one (``base``, its
    numbers) and the template that takes the numbers that differ among them as inputs."""

    base: fx.GraphModule
    base_numbers: list
    varying: list[int] = field(default_factory=list)
    module: fx.GraphModule | None = None
    compiled: object = None
    version: int = 0
    """Bumped when the template widens: a shape's values are read again."""


@dataclass
class Shape:
    """One shape's lowering as its family's numbers: where they differ from the base."""

    family: Family
    diff: dict[int, int | float]
    values: tuple = ()
    version: int = -1

    def args(self) -> tuple:
        """The template's number inputs for this shape."""
        f = self.family
        if self.version != f.version:
            self.values = tuple(self.diff.get(i, f.base_numbers[i]) for i in f.varying)
            self.version = f.version
        return self.values


@dataclass
class Templates:
    """The templates of one module's other shapes (see the module docstring).
    ``compile``: ``torch.compile``'s (args, kwargs) once the module is compiled, else
    ``None`` (the templates run eagerly)."""

    compile: tuple[tuple, dict] | None = None
    families: dict[tuple, Family] = field(default_factory=dict)
    compilations: int = 0
    """Templates compiled (dynamo compiles each once more when its numbers first change)."""

    def add(self, gm: fx.GraphModule, training: bool) -> Shape:
        """``gm`` (a lowering in the capture's train/eval mode) as a shape of its family,
        widening the family's template where its numbers differ; ``training``: the
        module's mode now, which a new template takes."""
        sig, nums = signature(gm), numbers(gm)
        fam = self.families.get(sig)
        if fam is None:
            fam = self.families[sig] = Family(gm, nums)
        diff = {i: b for i, (a, b) in enumerate(zip(fam.base_numbers, nums)) if a != b}
        if fam.module is None or not set(diff) <= set(fam.varying):
            fam.varying = sorted(set(fam.varying) | set(diff))
            fam.module = template(fam.base, set(fam.varying))
            set_train_mode([fam.module], training)
            fam.compiled = None
            fam.version += 1
        return Shape(fam, diff)

    def run(self, shape: Shape, flat: list):
        """The shape's lowering on ``flat``: its family's template (compiled once the
        module is) with the shape's numbers."""
        fam = shape.family
        if self.compile is None:
            return fam.module(*flat, *shape.args())
        if fam.compiled is None:
            fam.compiled = CompiledOrEager(fam.module, "another shape's graph", *self.compile[0],
                                           **self.compile[1])
            self.compilations += 1
        return fam.compiled(*flat, *shape.args())

    def modules(self) -> list[fx.GraphModule]:
        """The templates (train/eval switches reach them)."""
        return [f.module for f in self.families.values() if f.module is not None]

    def recompiled(self) -> None:
        """The templates' code changed (a train/eval switch): compile them again when run."""
        for f in self.families.values():
            f.compiled = None


__all__ = ["Family", "Shape", "Templates", "numbers", "signature", "template"]
