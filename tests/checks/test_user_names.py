"""Messages and ``describe()`` name things as the user does: a unit by its
class (never the ``Sharded...`` subclass ``fully_shard`` swaps in), a
parameter by its fully-qualified name in the whole model, also where the
annotated module alone knows only its own names (a tied weight in a unit
of its own).

Run: ``PYTHONPATH=. python -m pytest -q tests/checks/test_user_names.py`` (gloo, 3 ranks).
"""

import pytest
import torch
import torch.distributed as dist

from fsdp_compose import describe, fully_shard
from fsdp_compose.runtime.state import state_of
from fsdp_compose.testing import GPT, GPTConfig
from tests.harness import run_distributed

WORLD = 3


def _tied_in_units_of_their_own(first: str) -> str:
    """Both tied modules annotated alone and no root above them: the units
    are not one model, refused at the first forward (the lazy init)."""
    model = GPT(GPTConfig(tie_embeddings=True))
    modules = {"tok_emb": model.tok_emb, "head": model.head}
    fully_shard(modules[first])
    fully_shard(modules["head" if first == "tok_emb" else "tok_emb"])
    tokens = torch.zeros(2, 4, dtype=torch.long)
    try:
        model.loss(tokens, tokens)
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("first", ["tok_emb", "head"])
def test_the_tied_parameter_refusal_names_both_fqns(first):
    for message in run_distributed(WORLD, _tied_in_units_of_their_own, first):
        second = "head" if first == "tok_emb" else "tok_emb"
        assert message.startswith(f"parameter '{second}.weight' is the same tensor as "
                                  f"'{first}.weight'"), message
        assert "common ancestor" in message


def _names_after_a_step() -> dict:
    model = GPT(GPTConfig())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    tokens = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model.loss(tokens, tokens).backward()  # the root's lazy init names the units
    try:
        model.set_reshard_after_forward(WORLD + 1)
        message = ""
    except ValueError as error:
        message = str(error)
    report = describe(model)
    return {"message": message, "unit": state_of(model).unit.name,
            "types": [t for u in report.units for t in u.module_types],
            "model_type": report.model_type}


def test_units_are_named_by_the_users_class_in_messages_and_describe():
    for res in run_distributed(WORLD, _names_after_a_step):
        assert res["unit"] == "<root> (GPT)", res
        assert "(GPT)" in res["message"] or "(Block)" in res["message"], res["message"]
        assert "Sharded" not in res["message"], res["message"]
        assert res["model_type"] == "GPT" and set(res["types"]) == {"GPT", "Block"}, res
