"""Tools around ``fully_shard``: seeing what it did, and annotating a model
by a rule.

* :func:`describe` (``describe.py``): the units, flat buffers and parameter
  assignment of an annotated model as a :class:`ModelReport`; ``print`` it
  for a table per unit, ``to_dict()`` for JSON. Local, no collectives.
* :func:`fully_shard_by` (``annotate.py``): ``fully_shard`` every module a
  class or predicate matches, bottom-up, then the model itself.
"""

from .annotate import fully_shard_by
from .describe import BufferReport, ModelReport, ParamReport, Totals, UnitReport, describe

__all__ = ["describe", "fully_shard_by", "ModelReport", "UnitReport", "BufferReport",
           "ParamReport", "Totals"]
