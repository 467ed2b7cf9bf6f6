"""Optimizer state and torch's ``torch.distributed.checkpoint.state_dict``
functions on models annotated with ``fully_shard``.

After ``fully_shard`` every managed parameter leaves ``state_dict()`` as a
``DTensor`` of its original shape placed ``Shard(0)`` (torch FSDP2's layout),
and every optimizer holding managed parameters (hooked at its first step, or
by ``fsdp_compose.checkpoint.register_optimizer``) does the same for its
per-element state (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``). So
``get_state_dict``/``set_state_dict``, ``StateDictOptions`` and DCP work
unchanged. Every value is held to a single process that trains the same
seeded model on the global batch (each rank trains on its ``rank_slice``).

1. ``get_state_dict``: FQN keys, DTensor state equal to the reference's.
2. ``full_state_dict=True, cpu_offload=True``: full CPU tensors on rank 0 only.
3. Exact resume through ``dcp.save``/``dcp.load``, also across world sizes.
4. ``optimizer.state_dict()``/``load_state_dict()`` on the same job, and
   ``register_optimizer`` for an optimizer that never stepped.
5. ``broadcast_from_rank0`` for the model and the optimizer.
6. Adapter-only saving (``ignore_frozen_params``) moves no frozen weight.
7. Hugging Face Llama + PEFT LoRA: adapter-only and full DCP checkpoints.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compose import param_info
from fsdp_compose.checkpoint import register_optimizer
from tests._models import (TinyLM, build_lm, global_mean, rank_slice, shard_blocks_and_root,
                           token_batch)
from tests._training import make_optimizer
from tests.harness import run_distributed

GLOBAL_BATCH = 6  # divisible by 2 and 3: the same global batch on every world size
OPTIMS = ["sgd", "adamw"]
STATE_ATOL = 1e-6
TIMEOUT = 120


# ------------------------------------------------------------------ helpers
def _optim(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    """SGD with momentum, or AdamW with decay / no-decay groups (two param
    groups: the checkpoint must keep them apart) and non-default betas (to
    see hyper-parameters survive). The same for a sharded model and the
    unsharded reference (``make_optimizer`` reads the original ndim)."""
    optim = make_optimizer(model, name)
    for group in optim.param_groups:
        if "betas" in group:
            group["betas"] = (0.8, 0.95)
    return optim


def _train(model, optim, steps, sharded: bool = True) -> list[float]:
    """Train on ``token_batch(step, GLOBAL_BATCH)`` (this rank's slice when
    ``sharded``); returns the global-batch losses."""
    losses = []
    for step in steps:
        tokens, targets = token_batch(step, GLOBAL_BATCH)
        if sharded:
            rank, world = dist.get_rank(), dist.get_world_size()
            tokens, targets = rank_slice(tokens, rank, world), rank_slice(targets, rank, world)
        loss = model.loss(tokens, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss) if sharded else loss.item())
    return losses


def _reference(name: str, steps: int, freeze=None):
    """The single-process run on the global batch: model, optimizer, losses."""
    model = build_lm()
    if freeze is not None:
        freeze(model)
    optim = _optim(model, name)
    losses = _train(model, optim, range(steps), sharded=False)
    return model, optim, losses


def _ref_state(model, optim) -> dict[str, dict]:
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: s for p, s in optim.state.items()}


def _describe(value):
    """Runs on every rank (collective for a DTensor): what the value is, and
    its full value."""
    if isinstance(value, DTensor):
        return {"kind": "dtensor", "placements": tuple(value.placements),
                "mesh_size": value.device_mesh.size(), "shape": tuple(value.shape),
                "local_shape": tuple(value.to_local().shape), "full": value.full_tensor()}
    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", "device": str(value.device), "shape": tuple(value.shape),
                "full": value.detach().clone()}
    return {"kind": type(value).__name__, "full": value}


def _describe_dict(d: dict) -> dict:
    return {k: _describe(v) for k, v in d.items()}


def _local_state(optim) -> list[dict]:
    """This rank's optimizer state (1-D slices and 'step'), in parameter order."""
    return [{k: v.detach().clone() if isinstance(v, torch.Tensor) else v
             for k, v in optim.state.get(p, {}).items()}
            for g in optim.param_groups for p in g["params"]]


def _states_equal(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.keys() != y.keys():
            return False
        for k in x:
            if isinstance(x[k], torch.Tensor):
                if isinstance(x[k], DTensor) or isinstance(y[k], DTensor):
                    return False
                if x[k].shape != y[k].shape or not torch.equal(x[k], y[k]):
                    return False
            elif x[k] != y[k]:
                return False
    return True


def _assert_dtensor(desc: dict, shape, world: int, what: str) -> None:
    assert desc["kind"] == "dtensor", f"{what}: {desc['kind']}, not a DTensor"
    assert desc["placements"] == (Shard(0),), f"{what}: placements {desc['placements']}"
    assert desc["mesh_size"] == world
    assert desc["shape"] == tuple(shape), f"{what}: shape {desc['shape']} vs {tuple(shape)}"


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, atol=STATE_ATOL) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    diff = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    assert diff <= atol, f"{what} differs from the reference by {diff:.3g} (atol {atol})"


# ============================================================================
# 1, 2, 4. get_state_dict, full/cpu_offload, optimizer.state_dict() round trip
# ============================================================================
def _state_dict_job() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in OPTIMS:
        model = shard_blocks_and_root(build_lm())
        optim = _optim(model, name)
        _train(model, optim, range(2))
        res: dict = {}
        # 1. sharded (DTensor) state dicts keyed by FQN
        msd, osd = get_state_dict(model, optim)
        res["msd"] = _describe_dict(msd)
        res["state"] = {fqn: _describe_dict(s) for fqn, s in osd["state"].items()}
        res["groups"] = copy.deepcopy(osd["param_groups"])
        # 2. full_state_dict + cpu_offload: rank 0 only
        fmsd, fosd = get_state_dict(
            model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        res["full_msd"] = _describe_dict(fmsd)
        res["full_osd_keys"] = sorted(fosd)
        if fosd:
            res["full_state"] = {fqn: _describe_dict(s) for fqn, s in fosd["state"].items()}
            res["full_groups"] = copy.deepcopy(fosd["param_groups"])
        # 4. plain optimizer.state_dict() / load_state_dict() on the same job
        snapshot = _local_state(optim)
        sd = copy.deepcopy(optim.state_dict())
        res["plain_keys"] = sorted(sd["state"])
        res["plain_kinds"] = sorted({(k, type(v).__name__) for s in sd["state"].values()
                                     for k, v in s.items()})
        res["plain_shapes_ok"] = all(
            tuple(v.shape) == tuple(param_info(p).shape)
            for i, p in enumerate(q for g in optim.param_groups for q in g["params"])
            for v in sd["state"][i].values() if isinstance(v, DTensor))
        _train(model, optim, [2])  # the state moves on ...
        res["moved_on"] = not _states_equal(_local_state(optim), snapshot)
        # torch's load_state_dict keeps the given 'step' tensors (AdamW steps them
        # in place): every load gets its own copy
        optim.load_state_dict(copy.deepcopy(sd))  # ... and comes back, as 1-D local slices
        res["restored"] = _states_equal(_local_state(optim), snapshot)
        # a never-stepped optimizer loads the same state dict once registered
        fresh = _optim(model, name)
        register_optimizer(fresh)
        register_optimizer(fresh)  # idempotent
        fresh.load_state_dict(copy.deepcopy(sd))
        res["fresh_restored"] = _states_equal(_local_state(fresh), snapshot)
        # ... and its first step is the one the original optimizer takes
        tokens, targets = token_batch(3, GLOBAL_BATCH)
        model.loss(rank_slice(tokens, rank, world), rank_slice(targets, rank, world)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        optim.step()
        after_original = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p, b in zip(model.parameters(), before):
                p.copy_(b)
        fresh.step()
        res["fresh_step_equal"] = all(torch.equal(p, a) for p, a in
                                      zip(model.parameters(), after_original))
        res["fresh_state_equal"] = _states_equal(_local_state(fresh), _local_state(optim))
        # full (unsharded) tensors load too: a single-process optimizer's state_dict()
        ref_model, ref_optim, _ = _reference(name, 2)  # on this rank alone
        from_full = _optim(model, name)
        register_optimizer(from_full)
        from_full.load_state_dict(copy.deepcopy(ref_optim.state_dict()))
        loaded = from_full.state_dict()
        equal = [torch.equal(loaded["state"][i][k].full_tensor(), v)  # a list: collective
                 for i, p in enumerate(q for g in ref_optim.param_groups for q in g["params"])
                 for k, v in ref_optim.state[p].items() if k != "step"]
        res["from_full_equal"] = bool(equal) and all(equal)
        out[name] = res
    return out


_STATE_RESULTS: dict[int, list] = {}


def _state_results(world: int) -> list:
    if world not in _STATE_RESULTS:
        _STATE_RESULTS[world] = run_distributed(world, _state_dict_job, timeout=TIMEOUT)
    return _STATE_RESULTS[world]


def _group_hparams(groups: list[dict]) -> list[dict]:
    """Hyper-parameters of each group (lists as tuples: torch's full-state-dict
    loading flattens and rebuilds ``betas`` as a list)."""
    return [{k: tuple(v) if isinstance(v, list) else v for k, v in g.items() if k != "params"}
            for g in groups]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", OPTIMS)
def test_get_state_dict_matches_single_process(world, name):
    ref_model, ref_optim, _ = _reference(name, 2)
    ref_params = dict(ref_model.named_parameters())
    ref_state = _ref_state(ref_model, ref_optim)
    per_element = {"sgd": ["momentum_buffer"], "adamw": ["exp_avg", "exp_avg_sq"]}[name]
    for rank, out in enumerate(_state_results(world)):
        res = out[name]
        # the model: every parameter a Shard(0) DTensor of its original shape
        assert list(res["msd"]) == list(ref_model.state_dict())
        for fqn, desc in res["msd"].items():
            _assert_dtensor(desc, ref_params[fqn].shape, world, f"rank {rank} model {fqn}")
            _assert_close(desc["full"], ref_params[fqn], f"rank {rank} model {fqn}", atol=1e-5)
        # the optimizer: keyed by the original FQNs
        assert sorted(res["state"]) == sorted(ref_state), f"rank {rank}: {sorted(res['state'])}"
        for fqn, state in res["state"].items():
            want = ref_state[fqn]
            assert sorted(state) == sorted(want), f"rank {rank} {fqn}: {sorted(state)}"
            for key in per_element:
                what = f"rank {rank} {name} {key} of {fqn}"
                _assert_dtensor(state[key], ref_params[fqn].shape, world, what)
                _assert_close(state[key]["full"], want[key], what)
            if "step" in want:
                assert state["step"]["kind"] != "dtensor"
                assert torch.equal(torch.as_tensor(state["step"]["full"]), want["step"])
        # param groups: hyper-parameters kept, parameters named by FQN in optimizer order
        ref_names = {p: n for n, p in ref_model.named_parameters()}
        want_groups = ref_optim.state_dict()["param_groups"]
        assert _group_hparams(res["groups"]) == _group_hparams(want_groups)
        assert [g["params"] for g in res["groups"]] == \
            [[ref_names[p] for p in g["params"]] for g in ref_optim.param_groups]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", OPTIMS)
def test_full_state_dict_cpu_offload_only_on_rank_zero(world, name):
    ref_model, ref_optim, _ = _reference(name, 2)
    ref_sd = ref_model.state_dict()
    ref_state = _ref_state(ref_model, ref_optim)
    results = _state_results(world)
    res0 = results[0][name]
    assert list(res0["full_msd"]) == list(ref_sd)
    for fqn, desc in res0["full_msd"].items():
        assert desc["kind"] == "tensor" and desc["device"] == "cpu", f"{fqn}: {desc['kind']}"
        _assert_close(desc["full"], ref_sd[fqn], f"full model {fqn}", atol=1e-5)
    assert res0["full_osd_keys"] == ["param_groups", "state"]
    assert sorted(res0["full_state"]) == sorted(ref_state)
    for fqn, state in res0["full_state"].items():
        for key, want in ref_state[fqn].items():
            desc = state[key]
            assert desc["kind"] == "tensor" and desc["device"] == "cpu", f"{fqn} {key}: {desc}"
            _assert_close(desc["full"], want, f"full optimizer {key} of {fqn}")
    assert _group_hparams(res0["full_groups"]) == \
        _group_hparams(ref_optim.state_dict()["param_groups"])
    # torch's semantics (rank0_only with cpu_offload): the other ranks get empty dicts
    for rank in range(1, world):
        assert results[rank][name]["full_msd"] == {}
        assert results[rank][name]["full_osd_keys"] == []


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", OPTIMS)
def test_optimizer_state_dict_round_trip_and_register_optimizer(world, name):
    kinds = {"sgd": {("momentum_buffer", "DTensor")},
             "adamw": {("exp_avg", "DTensor"), ("exp_avg_sq", "DTensor"), ("step", "Tensor")}}
    n_params = len(list(build_lm().parameters()))
    for rank, out in enumerate(_state_results(world)):
        res = out[name]
        assert res["plain_keys"] == list(range(n_params))  # torch's index keys
        assert set(res["plain_kinds"]) == kinds[name], f"rank {rank}: {res['plain_kinds']}"
        assert res["plain_shapes_ok"]
        assert res["moved_on"]
        assert res["restored"], f"rank {rank}: load_state_dict did not restore the state"
        assert res["fresh_restored"], f"rank {rank}: registered fresh optimizer"
        assert res["fresh_step_equal"], f"rank {rank}: the fresh optimizer stepped differently"
        assert res["fresh_state_equal"]
        assert res["from_full_equal"], f"rank {rank}: loading full tensors"


# ============================================================================
# 3. Exact resume through DCP, same and different world sizes
# ============================================================================
def _train_and_save(dirs: dict[str, str]) -> dict:
    """Per optimizer: 6 uninterrupted steps; then a second model trains 3
    steps and saves model and optimizer with DCP into ``dirs[name]``."""
    out = {}
    for name, ckpt in dirs.items():
        model = shard_blocks_and_root(build_lm())
        optim = _optim(model, name)
        full = _train(model, optim, range(6))
        model = shard_blocks_and_root(build_lm())
        optim = _optim(model, name)
        first = _train(model, optim, range(3))
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        out[name] = {"full": full, "first": first}
    return out


def _resume(sources: dict[str, dict[str, str]]) -> dict:
    """A new job: for each source world size and optimizer, a model built with
    another seed and a fresh optimizer load the checkpoint and train steps 4-6."""
    out: dict = {}
    for source, dirs in sources.items():
        for name, ckpt in dirs.items():
            torch.manual_seed(4321)  # other weights than build_lm(): loading must matter
            model = shard_blocks_and_root(TinyLM())
            optim = _optim(model, name)
            msd, osd = get_state_dict(model, optim)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
            out[(source, name)] = _train(model, optim, range(3, 6))
    return out


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    saved, dirs = {}, {}
    for world in (2, 3):
        root = tmp_path_factory.mktemp(f"ckpt_ws{world}")
        dirs[world] = {name: str(root / name) for name in OPTIMS}
        saved[world] = run_distributed(world, _train_and_save, dirs[world], timeout=TIMEOUT)
    resumed = {world: run_distributed(world, _resume, dirs, timeout=TIMEOUT)
               for world in (2, 3)}
    return saved, resumed


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", OPTIMS)
def test_exact_resume_same_world_size(resume_runs, world, name):
    saved, resumed = resume_runs
    for rank in range(world):
        full, first = saved[world][rank][name]["full"], saved[world][rank][name]["first"]
        assert first == full[:3]
        got = resumed[world][rank][(world, name)]
        assert got == full[3:], f"rank {rank}: resumed {got} vs uninterrupted {full[3:]}"
    # and the uninterrupted run is the single-process one
    _, _, ref_losses = _reference(name, 6)
    assert max(abs(a - b) for a, b in zip(saved[world][0][name]["full"], ref_losses)) <= 1e-5


@pytest.mark.parametrize("source,target", [(2, 3), (3, 2)])
@pytest.mark.parametrize("name", OPTIMS)
def test_resume_on_another_world_size(resume_runs, source, target, name):
    saved, resumed = resume_runs
    for want_world in (source, target):
        want = saved[want_world][0][name]["full"][3:]
        for rank in range(target):
            got = resumed[target][rank][(source, name)]
            diff = max(abs(a - b) for a, b in zip(got, want))
            assert diff <= 1e-5, f"saved on {source}, resumed on {target}, rank {rank}: " \
                                 f"{got} vs {want} (run on {want_world})"


# ============================================================================
# 5. broadcast_from_rank0
# ============================================================================
def _broadcast_job() -> dict:
    rank = dist.get_rank()
    if rank == 0:  # only rank 0 has the checkpoint: full plain tensors keyed by FQN
        ref = build_lm()
        ref_optim = _optim(ref, "adamw")
        _train(ref, ref_optim, range(2), sharded=False)
        full_msd = ref.state_dict()
        full_osd = get_optimizer_state_dict(ref, ref_optim)  # a plain model: no collective
    else:
        full_msd, full_osd = {}, {}
    torch.manual_seed(99)
    model = shard_blocks_and_root(TinyLM())
    optim = _optim(model, "adamw")  # never stepped
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_msd, options=options)
    set_optimizer_state_dict(model, optim, full_osd, options=options)
    osd = get_optimizer_state_dict(model, optim)
    return {"sent_msd": full_msd, "sent_osd": full_osd,
            "msd": _describe_dict(model.state_dict()),
            "state": {fqn: _describe_dict(s) for fqn, s in osd["state"].items()},
            "groups": osd["param_groups"],
            # the loaded state trains on like the reference
            "losses": _train(model, optim, range(2, 4))}


@pytest.mark.parametrize("world", [3])
def test_broadcast_from_rank0(world):
    ref_model, ref_optim, _ = _reference("adamw", 2)
    ref_params = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    ref_state = copy.deepcopy(_ref_state(ref_model, ref_optim))
    ref_groups = _group_hparams(ref_optim.state_dict()["param_groups"])
    ref_losses = _train(ref_model, ref_optim, range(2, 4), sharded=False)  # moves on in place
    results = run_distributed(world, _broadcast_job, timeout=TIMEOUT)
    # what rank 0 broadcast: its own single-process run (the same as ours up to
    # rounding: this process computes with more threads)
    sent_msd = results[0]["sent_msd"]
    sent_state = results[0]["sent_osd"]["state"]
    assert list(sent_msd) == list(ref_params) and sorted(sent_state) == sorted(ref_state)
    for fqn, want in ref_params.items():
        _assert_close(sent_msd[fqn], want, f"rank 0's {fqn}", atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_close(sent_state[fqn][key], ref_state[fqn][key], f"rank 0's {key} of {fqn}")
    for rank, res in enumerate(results):
        # every rank holds exactly rank 0's values
        assert list(res["msd"]) == list(ref_params)
        for fqn, desc in res["msd"].items():
            _assert_dtensor(desc, ref_params[fqn].shape, world, f"rank {rank} {fqn}")
            assert torch.equal(desc["full"], sent_msd[fqn]), f"rank {rank} {fqn}"
        assert sorted(res["state"]) == sorted(ref_state)
        for fqn, state in res["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                _assert_dtensor(state[key], ref_params[fqn].shape, world, f"{key} {fqn}")
                assert torch.equal(state[key]["full"], sent_state[fqn][key]), \
                    f"rank {rank}: {key} of {fqn}"
            assert torch.equal(torch.as_tensor(state["step"]["full"]), ref_state[fqn]["step"])
        assert _group_hparams(res["groups"]) == ref_groups
        assert max(abs(a - b) for a, b in zip(res["losses"], ref_losses)) <= 1e-5


# ============================================================================
# 6. Adapter-only saving: frozen parameters are not converted
# ============================================================================
TRAINABLE = ("norm.", "blocks.1.fc2.")  # the rest (embedding, block 0, fc1, lm_head) is frozen


def _freeze(model: torch.nn.Module) -> None:
    for n, p in model.named_parameters():
        if not n.startswith(TRAINABLE):
            p.requires_grad_(False)


_FUNCTIONAL = ("all_", "reduce_scatter", "broadcast")  # not wait_tensor, _wrap_tensor_autograd


class _Traffic(TorchDispatchMode):
    """Bytes each rank receives through c10d collectives (all-to-all output,
    all-gather output), also functional collectives (``DTensor.full_tensor``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, op = func.namespace, func.overloadpacket.__name__
        if ns == "c10d" or (ns == "_c10d_functional" and op.startswith(_FUNCTIONAL)):
            if ns == "_c10d_functional" and op == "all_gather_into_tensor":
                received = _nbytes(args[0]) * args[1]  # (input, group_size, group name)
            else:
                received = _nbytes(args[0])  # c10d ops: the output comes first
            self.ops.append((f"{ns}.{op}", received))
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(b for _, b in self.ops)


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _adapter_only_job() -> dict:
    model = build_lm()
    _freeze(model)  # before fully_shard: frozen and trainable params in separate flat buffers
    shard_blocks_and_root(model)
    optim = _optim(model, "adamw")
    _train(model, optim, range(1))
    # values are converted when first used ([Note: lazy checkpoint values]): taking a
    # state dict moves nothing; using its values moves each one's Shard(0) chunk. (The
    # conversion is called directly: a dispatch mode does not see the collectives run
    # inside a tensor subclass's own dispatch, where using a value converts it.)
    with _Traffic() as take_traffic:
        sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
        all_sd = get_model_state_dict(model)
    with _Traffic() as adapter_traffic:
        for value in sd.values():
            value._local_tensor.materialize()
    with _Traffic() as all_traffic:
        for value in all_sd.values():
            value._local_tensor.materialize()
    with _Traffic() as full_traffic:
        full_sd = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
    return {"sd": _describe_dict(sd), "full_sd": _describe_dict(full_sd),
            "all_keys": sorted(all_sd), "take_bytes": take_traffic.total,
            "adapter_ops": adapter_traffic.ops, "adapter_bytes": adapter_traffic.total,
            "all_bytes": all_traffic.total, "full_ops": full_traffic.ops,
            "full_bytes": full_traffic.total}


def test_adapter_only_state_dict_moves_no_frozen_weight():
    world = 2
    ref_model, _, _ = _reference("adamw", 1, freeze=_freeze)
    params = dict(ref_model.named_parameters())
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    assert sorted(trainable) == ["blocks.1.fc2.bias", "blocks.1.fc2.weight",
                                 "norm.bias", "norm.weight"]
    trainable_bytes = sum(p.numel() * 4 for p in trainable.values())
    frozen_bytes = sum(p.numel() * 4 for p in params.values() if not p.requires_grad)
    results = run_distributed(world, _adapter_only_job, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        assert sorted(res["sd"]) == sorted(trainable)
        assert sorted(res["full_sd"]) == sorted(trainable)
        assert res["all_keys"] == sorted(params)
        for fqn, desc in res["sd"].items():
            _assert_dtensor(desc, params[fqn].shape, world, f"rank {rank} {fqn}")
            _assert_close(desc["full"], params[fqn], f"rank {rank} {fqn}", atol=1e-5)
        for fqn, desc in res["full_sd"].items():
            assert desc["kind"] == "tensor", f"rank {rank} {fqn}: {desc['kind']}"
            _assert_close(desc["full"], params[fqn], f"rank {rank} full {fqn}", atol=1e-5)
        print(f"rank {rank}: adapter-only {res['adapter_bytes']} B {res['adapter_ops']}; "
              f"whole model {res['all_bytes']} B; adapter-only full {res['full_bytes']} B "
              f"{res['full_ops']}; trainable {trainable_bytes} B, frozen {frozen_bytes} B")
        assert res["take_bytes"] == 0
        # only the trainable parameters (root: norm; block 1: fc2) are converted, each once
        assert [op for op, _ in res["adapter_ops"]] == ["c10d.alltoall_base_"] * 4
        assert res["adapter_bytes"] <= trainable_bytes < frozen_bytes
        # full_state_dict: one all-gather per trainable parameter (padded; the
        # conversion before it runs inside DTensor's dispatch, unseen here)
        assert [op for op, _ in res["full_ops"]] == ["_c10d_functional.all_gather_into_tensor"] * 4
        assert res["full_bytes"] < frozen_bytes
    # Measured on 2 ranks (bytes received per rank, rank 0 / rank 1): adapter-only
    # 288 / 216 (its Shard(0) chunks of the 504 trainable bytes, none of the 6840
    # frozen ones); the whole model 3800 / 3544 (before lazy values, with one
    # exchange per buffer; now one per parameter, the same bytes).
    # Each rank receives exactly its dim-0 chunks: the ranks together receive
    # every converted byte once.
    assert sum(res["adapter_bytes"] for res in results) == trainable_bytes
    assert sum(res["all_bytes"] for res in results) == trainable_bytes + frozen_bytes


# ============================================================================
# 7. Hugging Face Llama + PEFT LoRA: adapter-only and full checkpoints
# ============================================================================
def _perturb(model, which) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if which(n, p):
                p.normal_(0.0, 0.3)


def _lora_job(adapter_dir: str, full_dir: str) -> dict:
    from tests import _hf  # keeps transformers off the hub
    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _hf.build_llama(lora=True)
    _hf.shard_layers_and_root(model)
    optim = make_optimizer(model, "adamw")
    _hf.lm_loss(model, _hf.local(_hf.batch(0, world), rank, world)).backward()
    optim.step()
    optim.zero_grad()
    ids = _hf.batch(99, 1)  # the same input on every rank
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    adapter = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    adapter_keys = sorted(adapter)
    dcp.save(adapter, checkpoint_id=adapter_dir)
    dcp.save(get_model_state_dict(model), checkpoint_id=full_dir)

    # adapter only: same pretrained base, other adapter weights
    fresh = _hf.build_llama(lora=True)
    torch.manual_seed(7)
    _perturb(fresh, lambda n, p: p.requires_grad)
    _hf.shard_layers_and_root(fresh)
    with torch.no_grad():
        before = fresh(input_ids=ids).logits
    sd = get_model_state_dict(fresh, options=StateDictOptions(ignore_frozen_params=True))
    dcp.load(sd, checkpoint_id=adapter_dir)
    set_model_state_dict(fresh, sd, options=StateDictOptions(strict=False))
    with torch.no_grad():
        from_adapter = fresh(input_ids=ids).logits

    # the full checkpoint into a model whose every weight differs
    other = _hf.build_llama(lora=True)
    torch.manual_seed(8)
    _perturb(other, lambda n, p: True)
    _hf.shard_layers_and_root(other)
    sd = get_model_state_dict(other)
    dcp.load(sd, checkpoint_id=full_dir)
    set_model_state_dict(other, sd)
    with torch.no_grad():
        from_full = other(input_ids=ids).logits
    return {"logits": logits, "before": before, "from_adapter": from_adapter,
            "from_full": from_full, "adapter_keys": adapter_keys,
            "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad)}


@pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")
# dcp.load in this process (no process group) warns that it loads in one process
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_peft_lora_adapter_only_and_full_checkpoints(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests import _hf
    adapter_dir, full_dir = str(tmp_path / "adapter"), str(tmp_path / "full")
    results = run_distributed(2, _lora_job, adapter_dir, full_dir, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        assert res["adapter_keys"] == res["trainable"]
        assert res["adapter_keys"] and all(".lora_" in k for k in res["adapter_keys"])
        assert not torch.allclose(res["before"], res["logits"], atol=1e-3)
        torch.testing.assert_close(res["from_adapter"], res["logits"], atol=1e-6, rtol=0)
        torch.testing.assert_close(res["from_full"], res["logits"], atol=1e-6, rtol=0)
    # the adapter checkpoint also loads into an unsharded PEFT model in one process
    plain = _hf.build_llama(lora=True)
    _perturb(plain, lambda n, p: p.requires_grad)
    sd = {k: v for k, v in plain.state_dict().items() if k in set(results[0]["trainable"])}
    assert sorted(sd) == results[0]["trainable"]
    dcp.load(sd, checkpoint_id=adapter_dir, no_dist=True)
    plain.load_state_dict(sd, strict=False)
    with torch.no_grad():
        logits = plain(input_ids=_hf.batch(99, 1)).logits
    torch.testing.assert_close(logits, results[0]["logits"], atol=1e-5, rtol=0)
