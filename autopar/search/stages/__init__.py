"""The plan-level search for one op placement: stage boundaries, schedule, micro-batches,
recomputation and ZeRO (``dp``), from per-layer prices (``layer_stats``,
``step_terms``, ``memory``, ``priced``)."""
