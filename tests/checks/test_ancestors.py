"""``_naming.py``: the modules that hold a module, found through
referrers only, never by reading attributes of arbitrary objects.

Run: ``PYTHONPATH=. python -m pytest -q tests/checks/test_ancestors.py`` (one process).
"""

import warnings

import torch.nn as nn

from fsdp_compose._naming import outermost_ancestors, qualified_names


class _Touchy:
    """Warns when any attribute is read (as ``torch.distributed.reduce_op``
    does): a walk over every live object with ``isinstance`` reads ``__class__``."""

    def __getattribute__(self, name):
        warnings.warn(f"read {name}", FutureWarning)
        return object.__getattribute__(self, name)


def test_outermost_ancestors_names_parameters_in_the_whole_model_without_warnings():
    inner = nn.Linear(3, 5)
    middle = nn.Sequential(nn.ReLU(), inner)
    middle.__dict__  # a materialised instance dict: the other way a parent holds _modules
    model = nn.ModuleDict({"body": middle, "head": nn.Linear(5, 2)})
    touchy = _Touchy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tops = outermost_ancestors([inner])
    assert tops == [model] and touchy is not None
    names = qualified_names(tops)
    assert names[id(inner.weight)] == "body.1.weight"
    assert names[id(model["head"].bias)] == "head.bias"


def test_a_module_held_by_no_module_is_its_own_outermost():
    alone = nn.Linear(2, 2)
    assert outermost_ancestors([alone]) == [alone]
