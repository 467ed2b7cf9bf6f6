"""The methods users call on a module annotated by ``fully_shard``:
:class:`ShardedModule`'s (``sharded_module.py``, with its collective
methods in ``comm_methods.py`` and its finalization methods in
``finalization_methods.py`` over ``manual_finalization.py``) and
``register_forward_method`` (``forward_methods.py``). Each routes to the
per-step machinery in ``runtime/``."""
