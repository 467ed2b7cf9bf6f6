"""``fsdp_compose.tools``: ``describe`` and ``fully_shard_by``.

Run: ``.venv/bin/python -m pytest -q tests/tools/test_tools.py``

``describe`` is checked against layout math done here independently (running
sums, padding to equal 16-byte aligned chunks, contiguous per-rank chunks)
and against ``param_info`` on every rank; ``fully_shard_by`` against the
hand-written annotations of ``tests/_models.py`` and ``tests/_hf.py``.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn as nn

from fsdp_compose import MixedPrecisionPolicy, fully_shard, param_info
from fsdp_compose.tools import describe, fully_shard_by
from fsdp_compose.tools._format import format_bytes
from tests import _models as M
from tests._comm_counter import CollectiveCounter
from tests.harness import run_distributed


# --------------------------------------------------------------- describe
def _describe_lm():
    """Runs on every rank: describe a sharded TinyLM before and after one
    training step, with param_info of every parameter. ``"flat"``: the
    layout math checked below is flat's (placements' is in test_placements_layout)."""
    model = M.build_lm()
    for block in model.blocks:
        fully_shard(block, placement="flat")
    fully_shard(model, placement="flat")
    rank, world = M.rank_world()
    with CollectiveCounter() as comm:
        if rank == 0:  # local: one rank alone may call it (a collective would hang below)
            describe(model)
        before = describe(model)
    assert not comm.counts, comm.counts
    tokens, targets = M.token_batch(0, M.PER_RANK * world)
    model.loss(M.rank_slice(tokens, rank, world), M.rank_slice(targets, rank, world)).backward()
    after = describe(model)
    infos = {n: tuple(param_info(p)) for n, p in model.named_parameters()}
    return {"before": before.to_dict(), "after": after.to_dict(), "text_before": str(before),
            "text_after": str(after), "infos": infos, "json": json.dumps(after.to_dict())}


def _check_layout_math(units: list[dict], world: int) -> None:
    for unit in units:
        for buffer in unit["buffers"]:
            params = buffer["params"]
            offsets = [0]
            for p in params[:-1]:
                offsets.append(offsets[-1] + p["numel"])
            assert [p["flat_offset"] for p in params] == offsets
            assert all(p["numel"] == math.prod(p["shape"]) for p in params)
            numel = sum(p["numel"] for p in params)
            align = 8  # chunks 16-byte aligned in fp32 and in 2-byte dtypes (records.buffer_layout)
            padded = -(-max(-(-numel // world), 1) // align) * align * world
            assert (buffer["numel"], buffer["unsharded_numel"]) == (numel, padded)
            assert buffer["padding"] == padded - numel < world * align
            assert buffer["shard_numel"] * world == padded
            assert buffer["unsharded_bytes"] == padded * 4  # float32
            assert buffer["shard_bytes"] == padded // world * 4
            for p in params:  # owner ranks: the chunks [r*S, (r+1)*S) the parameter meets
                first, last = p["flat_offset"], p["flat_offset"] + p["numel"] - 1
                S = buffer["shard_numel"]
                assert p["owner_ranks"] == list(range(first // S, last // S + 1))


@pytest.mark.parametrize("world", [2, 3])
def test_describe_sharded_lm_matches_layout_math_and_param_info(world):
    results = run_distributed(world, _describe_lm)
    reference = M.build_lm()
    shapes = {n: list(p.shape) for n, p in reference.named_parameters()}
    for res in results:
        json.loads(res["json"])  # to_dict() is JSON-serialisable
        for key in ("before", "after"):
            report = res[key]
            assert [u["fqns"] for u in report["units"]] == [[""], ["blocks.0"], ["blocks.1"]]
            assert [u["is_root"] for u in report["units"]] == [True, False, False]
            assert [u["reshard_after_forward"] for u in report["units"]] == [False, True, True]
            _check_layout_math(report["units"], world)
            params = {p["fqn"]: p for u in report["units"] for b in u["buffers"]
                      for p in b["params"]}
            assert {n: p["shape"] for n, p in params.items()} == shapes
            for name, (fqn, shape, numel, local_numel, local_offset) in res["infos"].items():
                got = params[name]
                assert (got["fqn"], got["shape"], got["numel"]) == (fqn, list(shape), numel)
                assert (got["local_numel"], got["local_offset"]) == (local_numel, local_offset)
            totals = report["totals"]
            assert totals["parameters"] == totals["trainable"] == sum(
                p.numel() for p in reference.parameters())
            assert totals["sharded_bytes_per_rank"] == sum(
                b["shard_bytes"] for u in report["units"] for b in u["buffers"])
            assert totals["largest_unit"] == "<root>"
            assert totals["unmanaged"] == 0 and report["unmanaged"] == []
        # no forward yet: root predicted, nothing recorded, no order-based prefetch
        assert not res["before"]["initialized"] and res["before"]["execution_order"] == []
        assert all(u["forward_prefetch"] == u["backward_prefetch"] == []
                   for u in res["before"]["units"])
        assert "no forward yet" in res["text_before"]
        after = res["after"]
        assert after["initialized"]
        assert after["execution_order"] == ["<root>", "blocks.0", "blocks.1"]
        plan = {u["label"]: (u["forward_prefetch"], u["backward_prefetch"]) for u in after["units"]}
        assert plan == {"<root>": (["blocks.0"], []), "blocks.0": (["blocks.1"], ["<root>"]),
                        "blocks.1": ([], ["blocks.0"])}
        for label in ("<root> (TinyLM)", "blocks.0 (MLPBlock)", "blocks.1 (MLPBlock)"):
            assert label in res["text_after"]
        assert all(name in res["text_after"] for name in shapes)
        assert "<root> -> blocks.0 -> blocks.1" in res["text_after"]
    # the ranks' slices tile every parameter exactly once; shards tile the padded buffer
    reports = [res["after"] for res in results]
    for u_index, unit in enumerate(reports[0]["units"]):
        for b_index, buffer in enumerate(unit["buffers"]):
            per_rank = [r["units"][u_index]["buffers"][b_index] for r in reports]
            assert sum(b["shard_numel"] for b in per_rank) == buffer["numel"] + buffer["padding"]
            for p_index, p in enumerate(buffer["params"]):
                pieces = sorted((b["params"][p_index]["local_offset"],
                                 b["params"][p_index]["local_numel"])
                                for b in per_rank if b["params"][p_index]["local_numel"])
                assert [o for o, _ in pieces] == [sum(n for _, n in pieces[:i])
                                                  for i in range(len(pieces))]
                assert sum(n for _, n in pieces) == p["numel"]
                owners = [r for r, b in enumerate(per_rank) if b["params"][p_index]["local_numel"]]
                assert owners == p["owner_ranks"]


def _describe_policies():
    """Frozen parameters, mixed precision and ignored parameters, before any forward."""
    model = M.build_lm()
    model.tok_emb.weight.requires_grad_(False)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=bf16, reshard_after_forward=False)
    fully_shard(model, ignored_params=[model.norm.bias])
    report = describe(model)
    return report.to_dict(), str(report)


def test_describe_frozen_mixed_precision_and_ignored():
    for report, text in run_distributed(2, _describe_policies):
        root, block = report["units"][0], report["units"][1]
        assert [b["trainable"] for b in root["buffers"]] == [False, True]  # tok_emb first
        assert [p["fqn"] for p in root["buffers"][0]["params"]] == ["tok_emb.weight"]
        assert block["mp_policy"]["param_dtype"] == "bfloat16"
        assert block["reshard_after_forward"] is False
        buffer = block["buffers"][0]
        assert (buffer["dtype"], buffer["compute_dtype"], buffer["reduce_dtype"]) == (
            "float32", "bfloat16", "float32")
        assert buffer["unsharded_bytes"] == buffer["unsharded_numel"] * 2  # gathered in bf16
        assert buffer["shard_bytes"] == buffer["shard_numel"] * 4  # stored in fp32
        totals = report["totals"]
        assert report["unmanaged"] == ["norm.bias"] and totals["unmanaged"] == M.D
        assert totals["parameters"] - totals["trainable"] == M.VOCAB * M.D
        assert totals["gradient_bytes_per_rank"] == sum(
            b["shard_bytes"] for u in report["units"] for b in u["buffers"] if b["trainable"])
        assert "frozen float32" in text and "bfloat16" in text and "norm.bias" in text
        # sizes read with their dtypes: gathered in bf16, stored in fp32
        assert (f"unsharded {format_bytes(block['unsharded_bytes'])} bfloat16, per rank "
                f"{format_bytes(block['shard_bytes'])} float32") in text, text
        assert (f"({format_bytes(buffer['unsharded_bytes'])} bfloat16); "
                f"{buffer['shard_numel']:,} per rank ({format_bytes(buffer['shard_bytes'])} "
                "float32)") in text, text


# ----------------------------------------------------------- fully_shard_by
def _structure(model: nn.Module) -> dict:
    return describe(model).to_dict()


MATCHES = {
    "class": lambda: M.MLPBlock,
    "predicate": lambda: lambda fqn, m: fqn.startswith("blocks.") and fqn.count(".") == 1,
    "tuple": lambda: (M.MLPBlock, nn.LayerNorm),
    "nested": lambda: (M.MLPBlock, nn.Linear),
}


def _annotate_by(kind):
    """Runs on every rank: fully_shard_by on one TinyLM, the hand-written
    annotation on another; both train one step."""
    by = fully_shard_by(M.build_lm(), MATCHES[kind]())
    by_hand = M.shard_blocks_and_root(M.build_lm())
    tokens, targets = M.token_batch(0, M.PER_RANK)
    by.loss(tokens, targets).backward()  # bottom-up and complete: it runs
    return {"by": _structure(by), "by_hand": _structure(by_hand)}


@pytest.mark.parametrize("kind", list(MATCHES))
def test_fully_shard_by_class_predicate_tuple_and_nested(kind):
    for res in run_distributed(2, _annotate_by, kind):
        units = [u["fqns"][0] for u in res["by"]["units"]]
        # annotated bottom-up and complete, so forward ran (the root first)
        assert res["by"]["execution_order"][0] == "<root>"
        if kind in ("class", "predicate"):  # the same units, layouts and policies
            res["by"].pop("initialized"), res["by"].pop("execution_order")
            res["by_hand"].pop("initialized"), res["by_hand"].pop("execution_order")
            for u in res["by"]["units"]:
                u["forward_prefetch"], u["backward_prefetch"] = [], []
            assert res["by"] == res["by_hand"]
        elif kind == "tuple":
            assert units == ["", "blocks.0", "blocks.1", "norm"]
        else:  # Linear layers inside each block first, then the blocks (no parameters left)
            assert units == ["", "blocks.0", "blocks.0.fc1", "blocks.0.fc2", "blocks.1",
                             "blocks.1.fc1", "blocks.1.fc2", "lm_head"]
            empty = [u["fqns"][0] for u in res["by"]["units"] if not u["buffers"]]
            assert empty == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize("match, hint", [
    ("MLPBlock", "type(m).__name__ == 'MLPBlock'"),
    (nn.Linear(2, 2), "type(module)"),
    ([M.MLPBlock], "tuple"),
    ((), "tuple"),
    ((M.MLPBlock, 3), "tuple"),
    (42, "predicate"),
])
def test_fully_shard_by_rejects_bad_match_types(match, hint):
    model = M.build_lm()  # the check comes before any annotation: no process group needed
    with pytest.raises(TypeError, match="match must be a module class") as info:
        fully_shard_by(model, match)
    assert hint in str(info.value)
    assert not any(type(m).__name__.startswith("Sharded") for m in model.modules())


def build_tied_lm() -> M.TinyLM:
    model = M.build_lm()
    model.lm_head.weight = model.tok_emb.weight  # (VOCAB, D) both
    return model


def _tied(how):
    """Runs on every rank: annotate a tied TinyLM, train two steps (SGD with
    momentum) on this rank's slice; losses, full parameters and warnings."""
    rank, world = M.rank_world()
    model = build_tied_lm()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "by":  # would annotate the embedding and the head alone: both skipped
            fully_shard_by(model, lambda fqn, m: isinstance(m, M.MLPBlock)
                           or fqn in ("tok_emb", "lm_head"))
        else:
            M.shard_blocks_and_root(model)
    optim = M.make_optim(model.parameters(), "sgd")
    losses = []
    for step in range(2):
        tokens, targets = M.token_batch(step, M.PER_RANK * world)
        loss = model.loss(M.rank_slice(tokens, rank, world), M.rank_slice(targets, rank, world))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(M.global_mean(loss))
    return {"losses": losses, "params": M.full_params(model),
            "warnings": [str(w.message) for w in caught if w.category is UserWarning],
            "tied": model.lm_head.weight is model.tok_emb.weight,
            "units": [u["fqns"] for u in _structure(model)["units"]]}


def test_fully_shard_by_skips_tied_modules_and_trains_like_the_hand_annotation():
    by, by_hand = run_distributed(2, _tied, "by"), run_distributed(2, _tied, "hand")
    reference = build_tied_lm()
    optim = M.make_optim(reference.parameters(), "sgd")
    ref_losses = []
    for step in range(2):
        loss = reference.loss(*M.token_batch(step, M.PER_RANK * 2))
        loss.backward()
        optim.step()
        optim.zero_grad()
        ref_losses.append(loss.item())
    M.assert_parity(by, {"losses": ref_losses, "params": M.plain_params(reference)})
    for got, want in zip(by, by_hand):
        assert got["tied"] and got["units"] == want["units"] == [[""], ["blocks.0"], ["blocks.1"]]
        assert got["losses"] == want["losses"]
        M.assert_dicts_close(got["params"], want["params"], atol=0.0)
        assert len(got["warnings"]) == 2 and not want["warnings"]
        for skipped, other in (("tok_emb", "lm_head"), ("lm_head", "tok_emb")):
            assert any(f"not annotating '{skipped}'" in w and f"'{other}.weight'" in w
                       for w in got["warnings"])


def _peft_by_layer_class():
    from tests import _hf
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    warnings.filterwarnings("ignore", category=FutureWarning)
    by = fully_shard_by(_hf.build_llama(lora=True), LlamaDecoderLayer)
    by_hand = _hf.build_llama(lora=True)
    _hf.shard_layers_and_root(by_hand)
    return _structure(by), _structure(by_hand)


def test_fully_shard_by_finds_decoder_layers_inside_a_peft_model():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    for by, by_hand in run_distributed(2, _peft_by_layer_class):
        assert by == by_hand
        assert [u["fqns"] for u in by["units"]] == [
            [""], ["base_model.model.model.layers.0"], ["base_model.model.model.layers.1"]]
        assert by["units"][0]["module_types"] == ["PeftModel"]
        # LoRA: frozen base weights and trainable adapters in separate buffers
        assert [b["trainable"] for b in by["units"][1]["buffers"]] == [False, True]
