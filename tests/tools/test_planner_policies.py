"""The planner takes the policies ``fully_shard`` takes: torch FSDP2's
``MixedPrecisionPolicy``, ``CPUOffloadPolicy`` and ``OffloadPolicy`` give
the estimate fsdp_compose's own give (``tools/planner/estimate.py``
converts them as ``fully_shard`` does: ``torch_policies.py``).

Run: ``PYTHONPATH=. python -m pytest -q tests/tools/test_planner_policies.py`` (one process).
"""

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp

import fsdp_compose
from fsdp_compose import estimate_memory, propose_units
from fsdp_compose.testing import GPT, GPTConfig

BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _model() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=97, d_model=48, n_layers=3))


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_torch_policies_give_the_same_estimate_as_ours(backend):
    model = _model()
    ours = estimate_memory(model, 3, backend=backend, mp_policy=fsdp_compose.MixedPrecisionPolicy(**BF16),
                           offload=fsdp_compose.CPUOffloadPolicy())
    theirs = estimate_memory(model, 3, backend=backend, mp_policy=torch_fsdp.MixedPrecisionPolicy(**BF16),
                             offload=torch_fsdp.CPUOffloadPolicy())
    assert theirs == ours
    assert ours == estimate_memory(model, 3, backend=backend,
                                   mp_policy=fsdp_compose.MixedPrecisionPolicy(**BF16), offload=True)
    if backend == "nccl":  # the policies count: not the estimate without them
        assert ours != estimate_memory(model, 3, backend=backend)


def test_torch_no_offload_and_default_policy_mean_none():
    model = _model()
    plain = estimate_memory(model, 3, backend="nccl")
    assert estimate_memory(model, 3, backend="nccl", mp_policy=torch_fsdp.MixedPrecisionPolicy(),
                           offload=torch_fsdp.OffloadPolicy()) == plain


def test_propose_units_takes_torch_policies():
    model = _model()
    budget = 1 << 40
    ours = propose_units(model, 3, budget, mp_policy=fsdp_compose.MixedPrecisionPolicy(**BF16))
    theirs = propose_units(model, 3, budget, mp_policy=torch_fsdp.MixedPrecisionPolicy(**BF16))
    assert theirs.estimate == ours.estimate and len(theirs.units) == len(ours.units)


def test_another_object_is_refused_naming_the_planner():
    with pytest.raises(TypeError, match=r"estimate_memory: mp_policy must be a "
                                        r"fsdp_compose\.policies\.MixedPrecisionPolicy"):
        estimate_memory(_model(), 3, mp_policy=torch.bfloat16)
