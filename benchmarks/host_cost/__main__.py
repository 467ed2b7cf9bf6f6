"""``python -m benchmarks.host_cost``: the host-cost proxy's table (``proxy.py``)."""

from benchmarks.host_cost.proxy import main

main()
