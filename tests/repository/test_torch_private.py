"""Private torch names live in ``fsdp_compose/_torch_private.py`` only.

* the package's source is scanned with ``ast``: outside the guard, no module
  imports or uses a torch name with a leading-underscore component
  (``torch._C``, ``torch.distributed._composable``, ``from torch.x import _y``,
  ``torch._C._current_graph_task_id()``, ``dist.distributed_c10d._get_default_store``,
  ``torch.Tensor._make_wrapper_subclass``), nor a private attribute of torch's
  tensors, storages, DTensors, meshes, process groups, modules or optimizers
  (``storage._swap_data_ptr_``, ``dtensor._local_tensor``), except the
  exemptions the guard's docstring lists;
* the guard itself imports nothing from the package;
* on this torch, every name the guard looks up exists (only the staging pool's
  ``_swap_data_ptr_`` may be missing: torch 2.11); a missing one raises
  :class:`TorchFeatureMissing` naming the torch version and what is missing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import fsdp_compose
from fsdp_compose import _torch_private as tp
from fsdp_compose.buffers.staging import StagingPool
from tests._training import assert_parity, train_reference, train_sharded
from tests.harness import run_distributed

PACKAGE = Path(fsdp_compose.__file__).parent
GUARD = PACKAGE / "_torch_private.py"

EXEMPT_ATTRS = {
    "_version",  # Tensor's version counter (see the guard's docstring)
    "_apply",    # nn.Module._apply: overridden, checked by require_override
}
"""Private attributes of torch objects the package may use directly."""

_TORCH_CLASSES = (torch.Tensor, torch.UntypedStorage, nn.Module, nn.Parameter, DTensor,
                  DeviceMesh, dist.ProcessGroup, dist.Store, dist.Work, torch.optim.Optimizer)


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


KNOWN_PRIVATE_ATTRS = {"_swap_data_ptr_", "_local_tensor", "_spec", "_concatenate",
                       "_get_sequence_number_for_group", "_post_accumulate_grad_hooks", "_cdata",
                       "_make_wrapper_subclass", "_execution_engine"}
"""Private attributes of torch objects the package has used, found even on a
torch that lacks them (``dir()`` finds the rest)."""


def _private_attrs_of_torch_objects() -> set[str]:
    names = {name for cls in _TORCH_CLASSES for name in dir(cls) if _is_private(name)}
    return (names | KNOWN_PRIVATE_ATTRS) - EXEMPT_ATTRS


def _dotted(node: ast.AST) -> tuple[str, list[str]] | None:
    """``(root name, [attr, ...])`` of an attribute chain ``a.b.c``, or ``None``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return node.id, parts[::-1]
    return None


def private_torch_uses(source: str, filename: str = "<string>") -> list[str]:
    """Every use of a private torch name in ``source``: ``"line: what"``."""
    tree = ast.parse(source, filename)
    torch_names: set[str] = set()  # local names bound to torch modules or objects
    found: list[str] = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_names.add(alias.asname or "torch")
                    if any(_is_private(p) for p in alias.name.split(".")):
                        report(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "torch":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                torch_names.add(alias.asname or alias.name)
                if any(_is_private(p) for p in full.split(".")):
                    report(node, f"from {node.module} import {alias.name}")
    private_attrs = _private_attrs_of_torch_objects()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _dotted(node)
            if chain is not None and chain[0] in torch_names:
                # only the longest chain: a.b._c.d reports once, at its outermost node
                parent_chain = ".".join([chain[0], *chain[1]])
                if any(_is_private(p) for p in chain[1]):
                    report(node, parent_chain)
            elif node.attr in private_attrs:
                report(node, f"<torch object>.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value in private_attrs:
            report(node, f"{node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                re.fullmatch(r"torch(\.\w+)+", node.value) and \
                any(_is_private(p) for p in node.value.split(".")):
            report(node, repr(node.value))
    # a.b._c.d is reported for a.b._c.d and a.b._c: keep one per line and root
    unique: dict[str, None] = {}
    for item in found:
        unique.setdefault(item, None)
    return _outermost(list(unique))


def _outermost(found: list[str]) -> list[str]:
    """Drop ``x.y`` where ``x.y.z`` on the same line is reported too."""
    return [f for f in found
            if not any(g != f and g.startswith(f + ".") for g in found)]


def _package_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != GUARD)


def test_no_private_torch_name_outside_the_guard():
    found = [use for path in _package_files()
             for use in private_torch_uses(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, (
        "private torch names outside fsdp_compose/_torch_private.py (import them from there, "
        "feature-checked, see its docstring):\n  " + "\n  ".join(found))


@pytest.mark.parametrize("source, expected", [
    ("import torch._dynamo", ["import torch._dynamo"]),
    ("from torch.distributed._composable import contract",
     ["from torch.distributed._composable import contract"]),
    ("from torch.autograd.grad_mode import _unsafe_preserve_version_counter",
     ["from torch.autograd.grad_mode import _unsafe_preserve_version_counter"]),
    ("import torch\nx = torch._C._current_graph_task_id()", ["torch._C._current_graph_task_id"]),
    ("import torch.distributed as dist\ndist.distributed_c10d._get_default_store()",
     ["dist.distributed_c10d._get_default_store"]),
    ("from torch.autograd import Variable\nVariable._execution_engine.queue_callback(f)",
     ["Variable._execution_engine.queue_callback"]),
    ("def f(s):\n    s._swap_data_ptr_(t)", ["<torch object>._swap_data_ptr_"]),
    ("def f(d):\n    return d._local_tensor", ["<torch object>._local_tensor"]),
    ("getattr(storage, '_swap_data_ptr_', None)", ["getattr(..., '_swap_data_ptr_')"]),
    ("import importlib\nimportlib.import_module('torch._dynamo')", ["'torch._dynamo'"]),
    # not private torch names
    ("import torch\nx = torch.nn.functional.relu", []),
    ("from torch.distributed.pipelining import PipelineStage as _Stage", []),
    ("def f(t):\n    return t._version, t.__class__", []),
    ("class A:\n    def f(self):\n        return self._unit", []),
])
def test_the_scan_finds_private_names(source, expected):
    assert [f.split(": ", 1)[1] for f in private_torch_uses(source)] == expected


def test_the_guard_imports_nothing_from_the_package():
    tree = ast.parse(GUARD.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("fsdp_compose"), \
                f"_torch_private.py line {node.lineno} imports from the package"
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("fsdp_compose") for a in node.names)


def _stand_ins() -> list[str]:
    return [name for name, value in vars(tp).items() if hasattr(value, tp.MISSING_MARK)]


def test_every_private_name_exists_on_this_torch():
    """A torch that drops or renames a name the package uses fails here,
    by name, before anything else does (``_swap_data_ptr_`` excepted: it
    came in torch 2.12, and on 2.11 the staging pool is off and the swap's
    stand-in is never called)."""
    assert _stand_ins() == ([] if tp.CAN_SWAP_STORAGE_DATA else ["swap_storage_data"])
    tp.local_scalar_dense_op()
    tp.dynamo_disable(lambda: None)
    assert not hasattr(tp.mem_tracker_class(), tp.MISSING_MARK)
    with tp.fake_tensor_mode():
        pass
    if not tp.CAN_SWAP_STORAGE_DATA:  # torch 2.11: the staging pool is off
        assert not hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def test_a_missing_name_raises_naming_torch_and_the_feature():
    stand_in = tp._lookup("torch.no_such_module", "_thing", "testing the guard", since="9.1")
    with pytest.raises(tp.TorchFeatureMissing) as info:
        stand_in(1, 2)
    message = str(info.value)
    assert "torch.no_such_module._thing" in message and "testing the guard" in message
    assert f"torch {torch.__version__}" in message and "torch>=9.1" in message

    cls = tp._lookup("torch", "_NoSuchClass", "testing the guard", cls=True)
    assert not isinstance(object(), cls)
    with pytest.raises(tp.TorchFeatureMissing, match="torch._NoSuchClass"):
        cls()

    class Sub(cls):  # a package class built on a missing base fails when used
        pass
    with pytest.raises(tp.TorchFeatureMissing):
        Sub()

    class Base:
        pass
    with pytest.raises(tp.TorchFeatureMissing, match=r"Base\.renamed .*fsdp_compose supports"):
        tp.require_override(Base, "renamed", "testing the guard")


def test_swapping_storage_data_without_the_feature_raises():
    swap = tp._storage_data_swapper(None)  # what a torch without _swap_data_ptr_ gets
    a = torch.empty(0, dtype=torch.uint8).untyped_storage()
    with pytest.raises(tp.TorchFeatureMissing, match=r"_swap_data_ptr_.*torch>=2\.12"):
        swap(a, torch.empty(4, dtype=torch.uint8).untyped_storage())


def test_staging_pool_is_off_exactly_where_storages_cannot_swap_memory():
    assert StagingPool().enabled is tp.CAN_SWAP_STORAGE_DATA


def test_staging_pool_off_allocates_and_frees():
    """The path of torch 2.11 (no ``_swap_data_ptr_``), run on any torch:
    fills allocate, drains free at once, nothing is pooled, and the
    storage object (which views point at) stays the same."""
    pool = StagingPool()
    pool.enabled = False
    storage = torch.empty(0, dtype=torch.uint8).untyped_storage()
    view = torch.empty(0, dtype=torch.uint8).set_(storage)
    for _ in range(3):
        pool.fill(storage, 1 << 16)
        assert storage.nbytes() == 1 << 16
        view.set_(storage)
        view.fill_(7)
        assert int(torch.empty(0, dtype=torch.uint8).set_(storage).sum()) == 7 << 16
        pool.drain(storage)
        assert storage.nbytes() == 0 and pool.pooled_bytes == 0
        pool.clear()


def _train_without_pool(*args):
    from fsdp_compose.buffers import staging
    saved = staging.CAN_SWAP_STORAGE_DATA
    staging.CAN_SWAP_STORAGE_DATA = False  # the pool a model builds is off, as on torch 2.11
    try:
        return train_sharded(*args)
    finally:
        staging.CAN_SWAP_STORAGE_DATA = saved


@pytest.mark.parametrize("recipe", ["blocks+root", "no-reshard-after-forward"])
def test_training_with_the_staging_pool_off_matches_one_process(recipe):
    results = run_distributed(2, _train_without_pool, recipe, "adamw", 3, "plain", "gpt", False)
    assert_parity(results, train_reference(2, "adamw", 3, "plain", "gpt", False), 1e-5)
