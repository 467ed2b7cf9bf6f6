"""The methods users call on a module annotated by ``fully_shard``
(:class:`ShardedModule`, ``register_forward_method``); each routes to the
runtime.
"""
