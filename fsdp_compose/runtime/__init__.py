"""The per-step runtime: units and their transitions, the hook router, the
collective queue, prefetch order, end of backward and parameter owners.
The checks plug in through ``protocols.py``; the runtime never imports them.
"""
