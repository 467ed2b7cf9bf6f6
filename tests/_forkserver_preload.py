"""What the harness's fork server runs once, before it forks a worker (``tests/harness.py``).

Every worker and ``run_fresh`` process starts from this state:

* torch, ``torch.distributed``, ``fsdp_compose`` imported;
* ``torch._dynamo`` imported: torch's optimizers and ``zero_grad`` are ``torch._disable_dynamo``
  wrappers, so the first optimizer of a process imports it (half a second of CPU per worker,
  about 70 workers in the default suite). A test about a process that has not imported it runs
  a new interpreter instead;
* the heap collected and frozen (``gc.freeze``): a worker's collections never walk the
  300k objects of these imports, and, not writing their headers, leave their memory shared
  with the server instead of copying it page by page into every worker.
"""

import gc

import torch
import torch._dynamo  # noqa: F401 - imported for its cost, once
import torch.distributed  # noqa: F401

import fsdp_compose  # noqa: F401

gc.collect()
gc.freeze()
