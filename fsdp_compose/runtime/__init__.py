"""The per-step runtime: training states, the prefetch order,
the collective queue (every all-gather and reduction of the step, buckets,
in-flight limits), the unit (one ``fully_shard`` call's transitions), the
model-wide end of backward, the hook router ``FullyShardState`` and the registry
of parameter owners. The checks plug in through ``observer.py`` and the
state's injected callables; the runtime never imports them."""
