"""On a CPU mesh, where torch's optimizers step one parameter at a time, no
rank holds much more of one parameter than FSDP2 would
(``setup/default_placement.split_whole_pieces``).

torch's optimizers step one parameter at a time on the CPU, with temporaries
the size of each piece, so their peak follows a rank's largest piece of a
parameter. In one flat buffer, an embedding beside a head of the same size
sits whole on each of two ranks; the default placement gives such a
parameter a buffer of its own on a CPU mesh, cut by rows as FSDP2's ``Shard(0)``
cuts it. ``benchmarks.step_memory`` measures the optimizer peak it saves
(BENCHMARKS.md).

Run: PYTHONPATH=$PWD python -m pytest -q tests/buffers/test_largest_piece_per_rank.py
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import sys
from unittest import mock

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from fsdp_compose import fully_shard, param_info
from fsdp_compose.setup.units import assign_placements
from fsdp_compose.setup import default_placement as placement_rule
from fsdp_compose.buffers.layout import FlatLayout, alignment
from fsdp_compose.buffers.records import ParamRecord, group_records
from fsdp_compose.setup.default_placement import largest_share_bytes
from fsdp_compose.runtime.state import state_of
from fsdp_compose.testing import GPT, GPTConfig
from fsdp_compose.tools.describe import describe
from tests._training import (RECIPES, TEST_DEVICE, assert_parity, build_model, cached_reference,
                             train_sharded)
from tests import harness
from tests.harness import run_distributed

ATOL = 1e-5
BENCHMARK_GPT = GPTConfig(vocab_size=16384, seq_len=128, d_model=512, n_heads=8, n_layers=1)


def _records(named: list[tuple[str, nn.Parameter]]) -> list[ParamRecord]:
    return [ParamRecord(param=p, slots=[], fqn=n, shape=p.shape) for n, p in named]


def _root_records(cfg: GPTConfig) -> list[ParamRecord]:
    """The records of a GPT's root unit (everything but the blocks), on the
    meta device: the rule needs shapes and dtypes only."""
    with torch.device("meta"):
        model = GPT(cfg)
    return _records([(n, p) for n, p in model.named_parameters() if not n.startswith("blocks.")])


def _largest_pieces(records: list[ParamRecord], world: int) -> dict[str, int]:
    """Each parameter's largest piece on one rank, in bytes, as the unit's
    buffers lay them out."""
    pieces = {}
    for group in group_records(records):
        itemsize = group[0].param.dtype.itemsize
        layout = FlatLayout([r.shape for r in group], world, [r.placement for r in group],
                            alignment(itemsize, 2))
        for i, r in enumerate(group):
            pieces[r.fqn] = layout.largest_piece(i) * itemsize
    return pieces


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_the_benchmark_roots_matrices_are_cut_as_fsdp2_cuts_them(world):
    """The benchmark GPT's root (an embedding and a head of 32 MiB each):
    over two ranks each sat whole on one rank; now no rank holds more of
    either than FSDP2's ``torch.chunk`` rows, and only the parameters that
    needed it got a buffer of their own."""
    records = _root_records(BENCHMARK_GPT)
    before = _largest_pieces(records, world)
    assign_placements(records, None, None, world, steps_on_cpu=True)
    after = _largest_pieces(records, world)
    by_name = {r.fqn: r for r in records}
    if world == 2:  # the case that made the rule: both were whole on one rank
        assert before["tok_emb.weight"] == before["head.weight"] == 32 * 2 ** 20
        assert [r.fqn for r in records if r.own_buffer] == ["tok_emb.weight", "head.weight"]
    for name in ("tok_emb.weight", "head.weight"):  # then cut exactly as FSDP2 cuts them
        assert after[name] <= largest_share_bytes(by_name[name], world), (name, after[name])
    assert len(group_records(records)) == 1 + sum(r.own_buffer for r in records)


def test_nothing_is_split_where_the_rule_does_not_apply():
    """On a CUDA mesh (``foreach`` optimizers), for a placement the user
    chose, for frozen parameters, for parameters on another mesh than the
    unit's and over one rank the buffers stay as they were."""
    def split(records, placement=None, world=2, host=True):
        assign_placements(records, placement, None, world, steps_on_cpu=host)
        return [r.fqn for r in records if r.own_buffer]

    assert split(_root_records(BENCHMARK_GPT), host=False) == []
    assert split(_root_records(BENCHMARK_GPT), placement="rows") == []
    assert split(_root_records(BENCHMARK_GPT), world=1) == []
    frozen = _root_records(BENCHMARK_GPT)
    for r in frozen:
        r.param.requires_grad_(False)
    assert split(frozen) == []
    elsewhere = _root_records(BENCHMARK_GPT)  # shard_placement_fn put them on another mesh
    for r in elsewhere:
        r.group = object()
    assert split(elsewhere) == []
    assert split(_root_records(BENCHMARK_GPT)) == ["tok_emb.weight", "head.weight"]  # CPU mesh


SHAPES = st.lists(st.one_of(st.tuples(st.integers(1, 64)),
                            st.tuples(st.integers(1, 64), st.integers(1, 40)),
                            st.tuples(st.integers(0, 9), st.integers(1, 7), st.integers(1, 5))),
                  min_size=1, max_size=7)


@settings(max_examples=150, deadline=None)
@given(shapes=SHAPES, world=st.integers(2, 8), slack=st.sampled_from([0, 64, 4096]),
       frozen=st.lists(st.booleans(), min_size=7, max_size=7))
def test_no_piece_exceeds_the_largest_share_by_more_than_the_slack(shapes, world, slack, frozen):
    """The rule's post-condition, for any shapes, world size and slack:
    where nothing was split, every trainable parameter's largest piece is
    at most the unit's largest ``Shard(0)`` piece plus the slack; where
    something was, at most that piece, or what the parameter holds alone
    in a buffer (chunks are whole alignment units); frozen parameters stay
    in one buffer."""
    with torch.device("meta"):
        params = [nn.Parameter(torch.empty(s), requires_grad=not frozen[i])
                  for i, s in enumerate(shapes)]
    records = _records([(f"p{i}", p) for i, p in enumerate(params)])
    saved = placement_rule.HOST_PIECE_SLACK_BYTES
    placement_rule.HOST_PIECE_SLACK_BYTES = slack
    try:
        assign_placements(records, None, None, world, steps_on_cpu=True)
    finally:
        placement_rule.HOST_PIECE_SLACK_BYTES = saved
    trainable = [r for r in records if r.param.requires_grad]
    if not trainable:
        assert not any(r.own_buffer for r in records)
        return
    split = any(r.own_buffer for r in records)
    bound = max(largest_share_bytes(r, world) for r in trainable) + (0 if split else slack)
    pieces = _largest_pieces(records, world)
    for r in trainable:
        alone = _largest_pieces([ParamRecord(r.param, [], r.fqn, r.shape, placement=r.placement)],
                                world)[r.fqn]
        assert pieces[r.fqn] <= max(bound, alone), (r.fqn, r.shape, r.placement, pieces, bound)
    assert not any(r.own_buffer for r in records if not r.param.requires_grad)


def train_without_slack(optim_name: str) -> dict:
    """Runs on every rank: the parity loop with no slack, so that the test
    GPT's uneven parameters get buffers of their own (on the CPU), and what
    each rank then holds of every parameter."""
    saved = placement_rule.HOST_PIECE_SLACK_BYTES
    placement_rule.HOST_PIECE_SLACK_BYTES = 0
    try:
        result = train_sharded("blocks+root", optim_name)
        model = RECIPES["blocks+root"](build_model())
    finally:
        placement_rule.HOST_PIECE_SLACK_BYTES = saved
    result["buffers"] = [len(s.unit.buffers) for s in _states(model)]
    result["described"] = str(describe(model))
    result["local"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    result["full"] = {n: tuple(param_info(p).shape) for n, p in model.named_parameters()}
    return result


def _states(model: nn.Module) -> list:
    return [s for s in (state_of(m) for m in model.modules()) if s is not None]


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_split_buffers_train_like_one_process(optim_name):
    """Three ranks, uneven shapes, SGD with momentum and AdamW: with buffers
    of their own the model trains as one process on the global batch, and
    no rank holds more of any parameter than FSDP2's largest piece of its
    unit."""
    world = 3
    results = run_distributed(world, train_without_slack, optim_name)
    assert_parity(results, cached_reference(world, optim_name), ATOL)
    on_host = TEST_DEVICE.type == "cpu"
    buffers = results[0]["buffers"]
    assert (max(buffers) > 1) == on_host, buffers
    assert ("a buffer of its own" in results[0]["described"]) == on_host
    if not on_host:
        return
    full = results[0]["full"]
    itemsize = 4
    units = {"root": [n for n in full if not n.startswith("blocks.")]}
    for n in full:
        if n.startswith("blocks."):
            units.setdefault(".".join(n.split(".")[:2]), []).append(n)
    for names in units.values():
        share = max(-(-full[n][0] // world) * math.prod(full[n][1:]) if full[n] else 1
                    for n in names) * itemsize
        for n in names:
            held = max(math.prod(r["local"][n]) for r in results) * itemsize
            assert held <= share, (n, [r["local"][n] for r in results], share)
        for n in names:  # whole rows on every rank, all rows once
            if len(full[n]) > 1:
                assert sum(r["local"][n][0] for r in results) == full[n][0], n


def _step_memory_rows(*args: str) -> dict[tuple[int, int, str], tuple[float, float]]:
    """``benchmarks.step_memory``'s tables, its two ranks in fresh processes (its count
    of frees is a process-wide setting): forked from the harness's server, where
    nothing has run, instead of spawned interpreters. (rank, step, phase) -> (ours,
    FSDP2) MiB."""
    from benchmarks import _two_ranks, step_memory
    forked = functools.partial(_two_ranks.run_two_ranks, context=harness._context())
    printed = io.StringIO()
    with mock.patch.object(step_memory, "run_two_ranks", forked), \
            mock.patch.object(sys, "argv", ["benchmarks.step_memory", *args]), \
            contextlib.redirect_stdout(printed):
        step_memory.main()
    out = printed.getvalue()
    rows, rank = {}, -1
    for line in out.splitlines():
        if line.startswith("GPT "):
            rank += 1
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            rows[(rank, int(cells[0]), cells[1])] = (float(cells[2]), float(cells[3]))
    return rows


@pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="measures the CPU's optimizer step")
def test_the_single_tensor_optimizer_peak_is_fsdp2s():
    """Measured: two ranks, a GPT whose embedding and head are 16 MiB each,
    CPU AdamW one parameter at a time. Every phase's peak on each rank, the
    optimizer's included, is at most FSDP2's (it was 16 MiB above: each
    matrix whole on one rank, two temporaries of its size). torch's own
    step (``--torch-step``): the default flat step steps whole runs."""
    rows = _step_memory_rows("--layers", "1", "--d-model", "256", "--heads", "4",
                             "--vocab", "16384", "--repeats", "2", "--batch-per-rank", "1",
                             "--torch-step")
    assert {(rank, phase) for rank, _, phase in rows} >= {
        (r, p) for r in (0, 1) for p in ("forward peak", "optimizer peak")}, rows
    for (rank, step, phase), (ours, fsdp2) in rows.items():
        assert ours <= fsdp2 + 0.05, (rank, step, phase, ours, fsdp2)


def hsdp_without_slack(mesh_shape: tuple[int, ...], reshard) -> dict:
    """Runs on every rank: ``tests/parallelism/test_hsdp.py``'s parity loop on
    ``mesh_shape`` with no slack, and the buffers each unit then gets."""
    from tests.parallelism.test_hsdp import _mesh, _train
    saved = placement_rule.HOST_PIECE_SLACK_BYTES
    placement_rule.HOST_PIECE_SLACK_BYTES = 0
    try:
        result = _train(mesh_shape, "adamw", reshard=reshard)
        mesh = _mesh(mesh_shape)
        model = build_model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)
    finally:
        placement_rule.HOST_PIECE_SLACK_BYTES = saved
    result["buffers"] = [len(s.unit.buffers) for s in _states(model)]
    return result


@pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="tests/parallelism/test_hsdp.py's CPU meshes")
@pytest.mark.parametrize("mesh_shape,reshard", [((2, 2), None), ((4,), 2)],
                         ids=["hsdp-2x2", "reshard-to-2"])
def test_split_buffers_under_hsdp_train_like_one_process(mesh_shape, reshard):
    """Buffers of their own over a shard group of a 2-D mesh, and under
    ``reshard_after_forward=2`` (gathered from the smaller group in
    backward): parity with one process, AdamW."""
    from tests.parallelism.test_hsdp import _assert_parity
    results = run_distributed(4, hsdp_without_slack, mesh_shape, reshard, timeout=120)
    _assert_parity(results, cached_reference(4, "adamw"))
    assert max(results[0]["buffers"]) > 1, results[0]["buffers"]


def with_split_buffers(function: str, *args):
    """Runs on every rank: ``tests/core/test_placements.py``'s ``function`` where
    the placement ``"split"`` is the default one with no slack (buffers of
    their own on the CPU)."""
    from tests.core import test_placements
    saved = placement_rule.HOST_PIECE_SLACK_BYTES
    placement_rule.HOST_PIECE_SLACK_BYTES = 0
    test_placements.PLACEMENTS["split"] = (None, None)
    try:
        return getattr(test_placements, function)(*args)
    finally:
        placement_rule.HOST_PIECE_SLACK_BYTES = saved
        del test_placements.PLACEMENTS["split"]


@pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="buffers of their own are the CPU's")
@pytest.mark.parametrize("saved_as,loaded_as", [("split", "shard0"), ("rows", "split")])
def test_state_dicts_cross_split_buffers(saved_as, loaded_as):
    """A state dict saved with buffers of their own loads under FSDP2's
    layout, and one saved in one buffer loads into split buffers: exact."""
    for res in run_distributed(3, with_split_buffers, "save_and_load_across", saved_as,
                               loaded_as):
        for key, want in res["want"].items():
            torch.testing.assert_close(res["loaded"][key], want, rtol=0, atol=0)
            torch.testing.assert_close(res["loaded_full"][key], want, rtol=0, atol=0)
            assert res["placements"][key] == "(Shard(dim=0),)", (key, res["placements"][key])


@pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="buffers of their own are the CPU's")
@pytest.mark.parametrize("saved_as,loaded_as", [("split", "owned"), ("owned", "split")])
def test_optimizer_state_crosses_split_buffers(saved_as, loaded_as):
    """AdamW's state saved with buffers of their own resumes under another
    layout and back, and the next step agrees."""
    for res in run_distributed(3, with_split_buffers, "resume_under_another_placement",
                               saved_as, loaded_as):
        for key, want in res["source"].items():
            torch.testing.assert_close(res["target"][key], want, rtol=0, atol=1e-6)
        assert res["kinds"]


@pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="buffers of their own are the CPU's")
def test_split_buffers_under_mixed_precision_equal_one_buffer():
    """bf16 compute, fp32 reduction, accumulation without sync: buffers of
    their own train bit for bit as one flat buffer does."""
    split = run_distributed(2, with_split_buffers, "train_placed", "split", "adamw", 3,
                            "accum-nosync", True)
    flat = run_distributed(2, with_split_buffers, "train_placed", "flat0", "adamw", 3,
                           "accum-nosync", True)
    for got, want in zip(split, flat):
        assert got["losses"] == want["losses"]
        for key, value in want["params"].items():
            torch.testing.assert_close(got["params"][key], value, rtol=0, atol=0)


@pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="buffers of their own are the CPU's")
def test_split_buffers_materialize_from_the_meta_device():
    """Built on the meta device, split, materialised: an eager build's values."""
    torch.manual_seed(1234)
    from tests._training import CFG
    want = {n: p.detach() for n, p in GPT(CFG).named_parameters()}
    for res in run_distributed(3, with_split_buffers, "materialized_like_eager", "split"):
        for key, value in want.items():
            torch.testing.assert_close(res["got"][key], value, rtol=0, atol=0)
