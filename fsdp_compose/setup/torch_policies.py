"""torch FSDP2's policy objects, accepted by ``fully_shard`` and converted to ours.

:func:`as_mp_policy` and :func:`as_offload_policy` convert torch's
``MixedPrecisionPolicy`` / ``CPUOffloadPolicy`` / ``OffloadPolicy`` field by
field, so ported code keeps passing them.

Invariants:
    * a converted policy behaves as under the installed torch's
      ``fully_shard`` (``reduce_dtype=None``: :data:`REDUCE_FOLLOWS_GRAD_DTYPE`);
    * torch's "no policy" objects (every field at its default, the
      ``OffloadPolicy()`` base class) become ``None``;
    * a field we lack that is not at its default, or an object of another
      class, raises ``TypeError`` naming every class's package; the check
      reads only the arguments, so every rank raises alike.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.torch_version import TorchVersion

from ..policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["as_mp_policy", "as_offload_policy"]


def as_mp_policy(policy: object, caller: str = "fully_shard") -> Optional[MixedPrecisionPolicy]:
    """``policy`` as our :class:`MixedPrecisionPolicy` (``None``: no mixed
    precision). ``caller`` names the function in messages."""
    if policy is None or isinstance(policy, MixedPrecisionPolicy):
        return policy
    torch_cls = _torch_class("MixedPrecisionPolicy")
    if torch_cls is None or not isinstance(policy, torch_cls):
        raise TypeError(
            f"{caller}: mp_policy must be a {_qualname(MixedPrecisionPolicy)} or a "
            f"{_torch_name('MixedPrecisionPolicy')}, got a {_qualname(type(policy))}.")
    values = _convertible_fields(policy, MixedPrecisionPolicy, "mp_policy", caller)
    if all(values[name] == field.default for name, field in _fields(MixedPrecisionPolicy).items()
           if name in values):
        return None  # torch's default policy: no mixed precision
    return MixedPrecisionPolicy(**values, reduce_follows_grad_dtype=REDUCE_FOLLOWS_GRAD_DTYPE)


REDUCE_FOLLOWS_GRAD_DTYPE: bool = TorchVersion(torch.__version__) >= (2, 15)
"""What torch's ``reduce_dtype=None`` means under the installed torch: the
gradient's dtype from 2.15, ``param_dtype`` before."""


def as_offload_policy(policy: object, caller: str = "fully_shard") -> Optional[CPUOffloadPolicy]:
    """``policy`` as our :class:`CPUOffloadPolicy` (``None``: no offloading)."""
    if policy is None or isinstance(policy, CPUOffloadPolicy):
        return policy
    if type(policy) is OffloadPolicy:
        return None  # the base class means "no offloading", as torch's
    torch_base = _torch_class("OffloadPolicy")
    torch_cpu = _torch_class("CPUOffloadPolicy")
    if torch_cpu is not None and type(policy) is torch_cpu:
        return CPUOffloadPolicy(**_convertible_fields(policy, CPUOffloadPolicy, "offload_policy",
                                                      caller))
    if torch_base is not None and type(policy) is torch_base:
        return None  # torch's base class means "no offloading"
    raise TypeError(
        f"{caller}: offload_policy must be a {_qualname(CPUOffloadPolicy)}, a "
        f"{_torch_name('CPUOffloadPolicy')} or a {_torch_name('OffloadPolicy')} (no "
        f"offloading), got a {_qualname(type(policy))}.")


# ----------------------------------------------------------------- helpers
def _torch_class(name: str) -> Optional[type]:
    """torch's FSDP2 class ``name`` (``None`` where this torch has none)."""
    try:
        import torch.distributed.fsdp as torch_fsdp
    except ImportError:  # torch built without distributed
        return None
    return getattr(torch_fsdp, name, None)


def _torch_name(name: str) -> str:
    cls = _torch_class(name)
    return _qualname(cls) if cls is not None else f"torch.distributed.fsdp.{name}"


def _qualname(cls: type) -> str:
    """The class with its package (two classes of one name must read apart)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _convertible_fields(policy: object, ours: type, argument: str,
                        caller: str) -> dict[str, object]:
    """``policy``'s field values that ``ours`` has too; a field ``ours`` lacks
    must hold its default."""
    mine = _fields(ours)
    values: dict[str, object] = {}
    for field in dataclasses.fields(policy):  # type: ignore[arg-type]
        value = getattr(policy, field.name)
        if field.name in mine:
            values[field.name] = value
        elif value != field.default:
            raise TypeError(
                f"{caller}: {argument}={_qualname(type(policy))}(..., {field.name}={value!r}) "
                f"cannot be converted: {_qualname(ours)} has no field '{field.name}'. Pass a "
                f"{_qualname(ours)} (fields: {', '.join(mine)}), or leave '{field.name}' at "
                f"its default ({field.default!r}).")
    return values
