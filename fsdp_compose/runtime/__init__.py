"""The per-step runtime: units and their transitions, the hook router
``FullyShardState``, the collective queue, prefetch order, end of backward
and the registry of parameter owners. The checks plug in through
``protocols.py`` and the state's injected callables; the runtime never
imports them."""
