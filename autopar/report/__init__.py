"""Reading a plan: the summary in words (``summary``), ``explain`` (``explain``), the
step at other shapes (``shapes``: ``predict``), the per-node table (``table``), the predicted timeline and trace (``timeline``) and every
collective of a step as a table (``collective_table``).

It reads plans and may import :mod:`autopar.sharding`, :mod:`autopar.capture`,
:mod:`autopar.runtime`, :mod:`autopar.plans` and :mod:`autopar.cost_models`; it never
imports :mod:`autopar.search` or :mod:`autopar.module`.
"""

from autopar.plans.data import register_reader
from autopar.report.explain import diff, explain
from autopar.report.shapes import predict
from autopar.report.summary import layer_view, summary, summary_numbers
from autopar.report.table import node_table

for _name, _fn in (("summary", summary), ("summary_numbers", summary_numbers),
                   ("layer_view", layer_view), ("node_table", node_table), ("explain", explain),
                   ("diff", diff), ("predict", predict)):
    register_reader(_name, _fn)
