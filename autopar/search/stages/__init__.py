"""The plan-level search for one op placement: stage boundaries, schedule, micro-batches,
recomputation and ZeRO (``dp``; its split dynamic program in ``split_search``), from
per-layer prices (``layer_stats``) and one stage's price (``price``, from ``step_terms``,
``memory``; the answer's types in ``priced``)."""
