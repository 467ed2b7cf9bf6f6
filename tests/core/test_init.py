"""Deferred (meta-device) initialisation and loading whole weights into a
sharded model: ``fully_shard`` on meta modules, ``materialize``,
``to_empty``, ``sync_module_states``, ``scatter_full_state_dict`` and
``load_safetensors``.

Every value check compares with an eagerly built model in the test process:
full values through ``model.state_dict()`` (DTensors, ``full_tensor()``),
exactly where the same seed and the same initialisers make that possible.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from tests import _hf  # first: it keeps transformers off the hub
from fsdp_compose import fully_shard, materialize, sync_module_states  # noqa: E402
from fsdp_compose.checkpoint import load_safetensors, scatter_full_state_dict  # noqa: E402
from tests._models import (PER_RANK, SEED, TinyLM, build_lm, global_mean,  # noqa: E402
                           lm_loss, make_optim, rank_slice, rank_world, shard_blocks_and_root,
                           token_batch)
from tests.harness import run_distributed  # noqa: E402

TIMEOUT = 90
OPTIMS = ["sgd", "adamw"]
INIT_SEED = 4321  # the seed materialize runs from where it differs from the build seed


# ------------------------------------------------------------------ helpers
def _meta_lm(n_blocks: int = 2) -> TinyLM:
    with torch.device("meta"):
        return TinyLM(n_blocks)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Runs on every rank (collective): ``model.state_dict()`` with every
    DTensor made whole. Asserts managed parameters come as Shard(0) DTensors."""
    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            assert value.placements == (Shard(0),), (key, value.placements)
            value = value.full_tensor()
        out[key] = value.detach().clone()
    return out


def _assert_exact(got: dict, want: dict, what: str = "") -> None:
    assert got.keys() == want.keys(), f"{what}: keys {sorted(got)} vs {sorted(want)}"
    for key, w in want.items():
        g = got[key]
        assert g.shape == w.shape and g.dtype == w.dtype, \
            f"{what}{key}: {tuple(g.shape)} {g.dtype} vs {tuple(w.shape)} {w.dtype}"
        assert torch.equal(g, w), \
            f"{what}{key} differs by {(g.double() - w.double()).abs().max().item():.3g}"


def _train_lm(model: nn.Module, optim_name: str, steps: int = 3) -> list[float]:
    """Runs on every rank: ``steps`` steps on this rank's slice of the global batch."""
    rank, world = rank_world()
    optim = make_optim(model.parameters(), optim_name)
    losses = []
    for step in range(steps):
        tokens, targets = token_batch(step, world * PER_RANK)
        loss = lm_loss(model(rank_slice(tokens, rank, world)), rank_slice(targets, rank, world))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    return losses


def _catch(fn, *args, **kwargs) -> str:
    """The ``type: message`` of what ``fn`` raised ('' if it returned)."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported to the test process
        return f"{type(exc).__name__}: {exc}"
    return ""


class _LiveBytes:
    """Live tensor bytes of this process while active, from the PyTorch
    profiler's allocation events (CPU allocator, gloo's threads included;
    see benchmarks/memory.py). ``peak``: the largest running sum, counted
    from the moment it started."""

    def __init__(self) -> None:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.peak = 0
        self.end = 0

    def __enter__(self) -> "_LiveBytes":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return
        events = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if isinstance(node.extra_fields, torch._C._profiler._ExtraFields_Allocation):
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
        events.sort()
        total = 0
        for _, size in events:  # frees come as negative sizes
            total += size
            self.peak = max(self.peak, total)
        self.end = total


def _shard_bytes(numel: int, world: int, elem: int = 4) -> int:
    return -(-numel // world) * elem


# ===========================================================================
# 1. Meta init of TinyLM: the eager model's values, identity, training
# ===========================================================================
def meta_init_parity(optim_names: list[str]) -> dict:
    out: dict = {"losses": {}, "eager_losses": {}}
    for i, optim_name in enumerate(optim_names):
        model = _meta_lm()
        before = list(model.parameters())
        shard_blocks_and_root(model)
        if i == 0:
            out["meta_after_fully_shard"] = all(p.is_meta for p in model.parameters())
        torch.manual_seed(SEED)
        assert materialize(model) is model
        after = list(model.parameters())
        if i == 0:
            out["identity"] = len(before) == len(after) and all(
                a is b for a, b in zip(before, after))
            out["any_meta_left"] = any(t.is_meta for t in model.state_dict().values())
            out["values"] = _full_state(model)
            out["local_numel"] = sum(p.numel() for p in model.parameters())
        out["losses"][optim_name] = _train_lm(model, optim_name)
        out.setdefault("trained", {})[optim_name] = _full_state(model)

        eager = shard_blocks_and_root(build_lm())
        out["eager_losses"][optim_name] = _train_lm(eager, optim_name)
        out.setdefault("eager_trained", {})[optim_name] = _full_state(eager)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_meta_init_matches_eager_build_and_trains_identically(world):
    optims = OPTIMS if world > 1 else ["adamw"]
    results = run_distributed(world, meta_init_parity, optims, timeout=TIMEOUT)
    reference = build_lm().state_dict()
    total = sum(p.numel() for p in build_lm().parameters())
    for rank, res in enumerate(results):
        assert res["meta_after_fully_shard"], f"rank {rank}: fully_shard left the meta device"
        assert res["identity"], f"rank {rank}: materialize replaced parameter objects"
        assert not res["any_meta_left"]
        _assert_exact(res["values"], reference, f"rank {rank}: ")
        for optim_name in optims:
            # identical values and identical data: identical training, bit for bit
            assert res["losses"][optim_name] == res["eager_losses"][optim_name], \
                (rank, optim_name, res["losses"][optim_name], res["eager_losses"][optim_name])
            _assert_exact(res["trained"][optim_name], res["eager_trained"][optim_name],
                          f"rank {rank} {optim_name} after training: ")
    # only shards were allocated: the ranks' pieces add up to the model (plus padding)
    local = sum(res["local_numel"] for res in results)
    assert total <= local < total + 4 * world, (local, total)


def _revisiting_model() -> nn.Sequential:
    """The root unit holds layers 0 and 2; layer 1 is a unit of its own, so
    ``materialize`` closes the root unit before layer 2 is initialised."""
    return nn.Sequential(nn.Linear(3, 2, bias=False), nn.Sequential(nn.Linear(2, 2)),
                         nn.Linear(2, 3))


def hsdp_meta_values(shape: tuple[int, int]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    with torch.device("meta"):
        model = _revisiting_model()
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(SEED)
    materialize(model)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("shape", [(2, 2), (4, 1)], ids=["hsdp-2x2", "replicate-4x1"])
def test_meta_init_under_hsdp_matches_eager_build(shape):
    """Found by tests/core/test_fuzz_parity.py: closing the root unit compared the
    replicas' checksums over layer 2's uninitialised memory (each replica its
    own), and raised as if the ranks had been seeded differently."""
    torch.manual_seed(SEED)
    reference = _revisiting_model().state_dict()
    for rank, values in enumerate(run_distributed(4, hsdp_meta_values, shape, timeout=TIMEOUT)):
        _assert_exact(values, reference, f"rank {rank}: ")


def gpt_meta_values() -> dict:
    """The library's test GPT (tied-free, embeddings + attention blocks)."""
    from fsdp_compose.testing import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=97, seq_len=8, d_model=12, n_heads=3, n_layers=2)
    with torch.device("meta"):
        model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    torch.manual_seed(SEED)
    materialize(model)
    return _full_state(model)


def test_meta_init_of_the_test_gpt_matches_eager_build():
    from fsdp_compose.testing import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=97, seq_len=8, d_model=12, n_heads=3, n_layers=2)
    torch.manual_seed(SEED)
    reference = GPT(cfg).state_dict()
    for rank, values in enumerate(run_distributed(3, gpt_meta_values, timeout=TIMEOUT)):
        _assert_exact(values, reference, f"rank {rank}: ")


def unannotated_root_identity() -> dict:
    """Only the blocks are units: the root's own parameters (tok_emb, norm,
    lm_head) are unmanaged and materialised whole."""
    rank, _ = rank_world()
    model = _meta_lm()
    before = dict(model.named_parameters())
    for block in model.blocks:
        fully_shard(block)
    torch.manual_seed(SEED)
    materialize(model)
    out = {"materialize": sorted(n for n, p in model.named_parameters() if p is not before[n]),
           "values": _full_state(model)}
    with torch.device("cpu" if rank == 1 else "meta"):
        model = TinyLM()
    before = dict(model.named_parameters())
    state_dict = {k: v.clone() for k, v in model.state_dict().items()} if rank == 1 else None
    for block in model.blocks:
        fully_shard(block)
    scatter_full_state_dict(model, state_dict, src=1)
    out["scatter"] = sorted(n for n, p in model.named_parameters() if p is not before[n])
    return out


def test_unannotated_parameters_keep_identity():
    """``materialize`` and ``scatter_full_state_dict`` promise that
    parameters keep their identity (an optimizer may be built before);
    that includes parameters no unit manages (here the root's)."""
    results = run_distributed(2, unannotated_root_identity, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        _assert_exact(res["values"], build_lm().state_dict(), f"rank {rank}: ")
        assert res["materialize"] == [] and res["scatter"] == [], (
            f"rank {rank}: new parameter objects after materialize: {res['materialize']}, "
            f"after scatter_full_state_dict: {res['scatter']}")


# ===========================================================================
# 2. Meta init of a Hugging Face Llama
# ===========================================================================
def _meta_llama(**overrides):
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        return LlamaForCausalLM(_hf.llama_config(**overrides))


def hf_meta_init() -> dict:
    out = {}
    # (a) one pass of HF's _init_weights from INIT_SEED
    model = _meta_llama()
    _hf.shard_layers_and_root(model)
    torch.manual_seed(INIT_SEED)
    materialize(model, init_fn=model._init_weights)
    out["a_values"] = _full_state(model)
    out["a_buffers"] = {n: b.clone() for n, b in model.named_buffers()}
    # (b) replaying the eager construction (see the test's docstring)
    model = _meta_llama()
    _hf.shard_layers_and_root(model)
    inner = set(model.model.modules())

    def construct(m):  # what LlamaModel.__init__'s nn.Linear/nn.Embedding drew
        if m in inner and callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()

    def post_init(m):  # LlamaModel.post_init, then lm_head's construction and post_init
        if m in inner:
            model._init_weights(m)
        elif m is model.lm_head:
            m.reset_parameters()
            model._init_weights(m)

    torch.manual_seed(1234)  # build_llama's seed
    materialize(model, init_fn=construct)
    materialize(model, init_fn=post_init)  # nothing left on meta: re-initialises in place
    out["b_values"] = _full_state(model)
    out["b_buffers"] = {n: b.clone() for n, b in model.named_buffers()}
    ids = _hf.batch(0, 1)
    with torch.no_grad():
        out["b_logits"] = model(input_ids=ids).logits
    return out


def test_hf_llama_meta_init_matches_eager():
    """HF's eager build draws from the generator in this order:
    ``LlamaModel.__init__`` (every ``nn.Linear``/``nn.Embedding.__init__``
    runs ``reset_parameters()``), ``LlamaModel.post_init`` (``_init_weights``
    on every inner module, post-order ``smart_apply``: among the leaves that
    draw, the same order as ``modules()``), then ``LlamaForCausalLM``'s
    ``lm_head`` construction and its ``post_init``, which skips the inner
    modules already initialised. So one ``materialize(init_fn=_init_weights)``
    does not give ``build_llama()``'s values (the generator is elsewhere when
    each module draws), but

    (a) it equals an eager model re-initialised with ``apply(_init_weights)``
        from the same seed, and
    (b) two ``materialize`` passes that replay the eager order (inner
        ``reset_parameters``; then inner ``_init_weights``, and ``lm_head``'s
        ``reset_parameters`` + ``_init_weights``) give ``build_llama()``'s
        values exactly, logits included.

    The rotary ``inv_freq``/``original_inv_freq`` buffers (non-persistent,
    garbage after ``to_empty``) are set by ``_init_weights``."""
    results = run_distributed(2, hf_meta_init, timeout=TIMEOUT)
    eager = _hf.build_llama()
    built = {k: v.clone() for k, v in eager.state_dict().items()}
    built_buffers = {n: b.clone() for n, b in eager.named_buffers()}
    with torch.no_grad():
        logits = eager(input_ids=_hf.batch(0, 1)).logits
    torch.manual_seed(INIT_SEED)
    eager.apply(eager._init_weights)
    reinit = eager.state_dict()
    assert set(built_buffers) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    for rank, res in enumerate(results):
        _assert_exact(res["a_values"], reinit, f"rank {rank} (a): ")
        _assert_exact(res["b_values"], built, f"rank {rank} (b): ")
        # non-persistent rotary buffers (not in state_dict): set by _init_weights
        _assert_exact(res["a_buffers"], built_buffers, f"rank {rank} (a) buffer ")
        _assert_exact(res["b_buffers"], built_buffers, f"rank {rank} (b) buffer ")
        torch.testing.assert_close(res["b_logits"], logits, atol=1e-5, rtol=0)


# ===========================================================================
# 3. Memory: materialize keeps at most one unit whole
# ===========================================================================
WIDE, N_WIDE = 64, 8


class WideStack(nn.Module):
    """``N_WIDE`` Linear(64, 64) units and a small root (a Linear(64, 4)):
    one unit is 1/8 of the model, so "sharded + one unit" is far below
    "sharded + every unit"."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDE, WIDE) for _ in range(N_WIDE))
        self.head = nn.Linear(WIDE, 4)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _sharded_wide_stack_on_meta() -> WideStack:
    with torch.device("meta"):
        model = WideStack()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def materialize_memory() -> dict:
    """The live bytes of one ``materialize`` on a fresh model (deterministic:
    the library frees each whole unit when it closes it, whatever gloo's
    worker thread still holds of the all-gather)."""
    _, world = rank_world()
    model = _sharded_wide_stack_on_meta()
    # the cost of gathering one unit here: the gathered buffer, plus whatever the
    # backend stages (gloo on CPU allocates a copy of the all-gather's output)
    unit = WIDE * WIDE + WIDE
    shard = torch.zeros(-(-unit // world))
    with _LiveBytes() as one_gather:
        full = torch.empty(shard.numel() * world)
        dist.all_gather_into_tensor(full, shard)
    del full, shard
    torch.manual_seed(0)
    with _LiveBytes() as during:
        materialize(model)
    # the tracker sees gathers: every unit whole at once
    with _LiveBytes() as all_whole:
        model.unshard(recurse=True)
    model.reshard(recurse=True)
    return {"peak": during.peak, "end": during.end, "all_whole_peak": all_whole.peak,
            "one_gather_peak": one_gather.peak, "values": _full_state(model)}


def test_materialize_peak_memory_is_shards_plus_one_unit():
    """Peak live bytes during ``materialize`` <= 1.1 x (the shards + the
    cost of gathering the largest unit, measured on the same backend). With
    8 equal units, gathering all of them at once (or a few unit-sized
    temporaries more) breaks the bound."""
    world = 2
    results = run_distributed(world, materialize_memory, timeout=TIMEOUT)
    unit = WIDE * WIDE + WIDE
    units = [unit] * N_WIDE + [WIDE * 4 + 4]
    sharded = sum(_shard_bytes(n, world) for n in units)
    largest = max(-(-n // world) * world for n in units) * 4
    assert largest == unit * 4
    torch.manual_seed(0)
    reference = WideStack().state_dict()
    for rank, res in enumerate(results):
        bound = int(1.1 * (sharded + res["one_gather_peak"]))
        print(f"rank {rank}: materialize peak {res['peak']} B; bound {bound} B = 1.1 x (shards "
              f"{sharded} + one gather of the largest unit {res['one_gather_peak']} "
              f"[unit {largest}]); after {res['end']} B; all units whole "
              f"{res['all_whole_peak']} B")
        _assert_exact(res["values"], reference, f"rank {rank}: ")
        assert res["end"] >= sharded  # the shards stay allocated (and were seen)
        assert largest <= res["one_gather_peak"] <= 2 * largest + 1024
        # the tracker sees gathers, and gathering every unit would break the bound
        assert res["all_whole_peak"] >= sum(units) * 4
        assert sharded + res["all_whole_peak"] > bound
        assert res["peak"] <= bound, (
            f"rank {rank}: materialize peaked at {res['peak']} live bytes, more than 1.1 x "
            f"(shards {sharded} + one gather of the largest unit {res['one_gather_peak']}) "
            f"= {bound}")


# ===========================================================================
# 4. to_empty + elementwise init on the shards; 9. forward before materialise
# ===========================================================================
def to_empty_recipe() -> dict:
    model = _meta_lm()
    before = list(model.parameters())
    shard_blocks_and_root(model)
    # 9. a forward on meta shards names the fix
    tokens, _ = token_batch(0, PER_RANK)
    meta_forward = _catch(model, tokens)
    assert model.to_empty(device="cpu") is model
    after = list(model.parameters())
    identity = len(before) == len(after) and all(a is b for a, b in zip(before, after))
    on_cpu = all(p.device.type == "cpu" for p in after)
    local_numel = sum(p.numel() for p in after)
    with torch.no_grad():
        for p in model.parameters():
            nn.init.constant_(p, 0.5)
    values = _full_state(model)
    losses = _train_lm(model, "sgd", steps=1)
    return {"meta_forward": meta_forward, "identity": identity, "on_cpu": on_cpu,
            "local_numel": local_numel, "values": values, "losses": losses,
            "trained": _full_state(model)}


def test_to_empty_keeps_identity_and_allocates_only_shards_and_meta_forward_raises():
    world = 2
    results = run_distributed(world, to_empty_recipe, timeout=TIMEOUT)
    ref = build_lm()
    shapes = {k: v.shape for k, v in ref.state_dict().items()}
    total = sum(s.numel() for s in shapes.values())
    with torch.no_grad():
        for p in ref.parameters():
            nn.init.constant_(p, 0.5)
    opt = make_optim(ref.parameters(), "sgd")
    tokens, targets = token_batch(0, world * PER_RANK)
    loss = lm_loss(ref(tokens), targets)
    loss.backward()
    opt.step()
    trained = ref.state_dict()
    for rank, res in enumerate(results):
        msg = res["meta_forward"]
        assert msg.startswith("RuntimeError") and "still on the meta device at forward" in msg \
            and "fsdp_compose.materialize(model)" in msg, msg
        assert res["identity"] and res["on_cpu"]
        assert res["local_numel"] < total  # only a shard
        assert res["values"].keys() == shapes.keys()
        for key, value in res["values"].items():
            assert value.shape == shapes[key] and bool((value == 0.5).all()), key
        # one step like the same all-0.5 model trained eagerly on the global batch
        assert abs(res["losses"][0] - loss.item()) <= 1e-6, (res["losses"], loss.item())
        for key, value in trained.items():
            torch.testing.assert_close(res["trained"][key], value, atol=1e-6, rtol=0)
    assert sum(res["local_numel"] for res in results) >= total


# ===========================================================================
# 5. sync_module_states
# ===========================================================================
def sync_states(src: int, meta_elsewhere: bool) -> dict:
    rank, _ = rank_world()
    torch.manual_seed(rank)  # every rank different
    on_meta = meta_elsewhere and rank != src
    with torch.device("meta" if on_meta else "cpu"):
        model = TinyLM()
        model.register_buffer("scale", torch.randn(3))
    before = list(model.parameters())
    assert sync_module_states(model, src=src) is model
    identity = all(a is b for a, b in zip(before, model.parameters()))
    values = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shard_blocks_and_root(model)
    after_shard = _full_state(model)
    error = _catch(sync_module_states, model, src=src)
    return {"values": values, "identity": identity, "after_shard": after_shard, "error": error}


@pytest.mark.parametrize("world,src,meta_elsewhere", [(2, 0, False), (3, 1, True)])
def test_sync_module_states(world, src, meta_elsewhere):
    results = run_distributed(world, sync_states, src, meta_elsewhere, timeout=TIMEOUT)
    torch.manual_seed(src)
    ref = TinyLM()
    ref.register_buffer("scale", torch.randn(3))
    want = ref.state_dict()
    torch.manual_seed(src + 1)  # a different rank's values really were different
    assert not torch.equal(TinyLM().lm_head.weight, ref.lm_head.weight)
    for rank, res in enumerate(results):
        assert res["identity"], f"rank {rank}: sync_module_states replaced parameters"
        _assert_exact(res["values"], want, f"rank {rank}: ")
        _assert_exact(res["after_shard"], want, f"rank {rank} after fully_shard: ")
        assert res["error"].startswith("ValueError") and "before fully_shard" in res["error"], \
            f"rank {rank}: {res['error']!r}"


# ===========================================================================
# 6. materialize with ranks seeded differently
# ===========================================================================
def materialize_unseeded() -> str:
    rank, _ = rank_world()
    model = shard_blocks_and_root(_meta_lm())
    torch.manual_seed(100 + rank)
    error = _catch(materialize, model)
    # the process group is still usable afterwards (every rank raised at the same point)
    t = torch.ones(1)
    dist.all_reduce(t)
    return error


def test_materialize_with_different_seeds_raises_on_every_rank():
    results = run_distributed(3, materialize_unseeded, timeout=TIMEOUT)
    for rank, error in enumerate(results):
        assert error.startswith("RuntimeError"), f"rank {rank}: {error!r}"
        assert "initialised different values" in error and "torch.manual_seed" in error, error


# ===========================================================================
# 7. Pretrained weights from rank 0: scatter_full_state_dict
# ===========================================================================
PRETRAINED_LAYERS = 6  # one layer is ~15% of the model: a whole copy stands out


def _pretrained_llama():
    """The "pretrained" model: seeded, then perturbed so no initialiser
    could reproduce it."""
    model = _hf.build_llama(num_hidden_layers=PRETRAINED_LAYERS)
    g = torch.Generator().manual_seed(77)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


class _ReceivedBytes(TorchDispatchMode):
    """Bytes of the output tensors of every scatter/broadcast dispatched while active."""

    OPS = (torch.ops.c10d.scatter_.default, torch.ops.c10d.broadcast_.default)

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.OPS:
            self.nbytes += sum(t.numel() * t.element_size() for t in args[0])
        return func(*args, **(kwargs or {}))


def scatter_pretrained() -> dict:
    rank, world = rank_world()
    if rank == 0:
        model = _pretrained_llama()
        state_dict = {k: v.clone() for k, v in model.state_dict().items()}
    else:
        model, state_dict = _meta_llama(num_hidden_layers=PRETRAINED_LAYERS), None
    before = list(model.parameters())
    _hf.shard_layers_and_root(model)
    with _LiveBytes() as live, _ReceivedBytes() as received:
        scatter_full_state_dict(model, state_dict if rank == 0 else None)
    out = {"identity": all(a is b for a, b in zip(before, model.parameters())),
           "peak": live.peak, "received": received.nbytes,
           "local_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "buffers": {n: b.clone() for n, b in model.named_buffers()},
           "values": _full_state(model)}
    with torch.no_grad():
        out["logits"] = model(input_ids=_hf.batch(1, 1)).logits
    # a mis-shaped and a missing key raise on every rank
    if rank == 0:
        bad = dict(state_dict)
        bad["lm_head.weight"] = torch.zeros(3, 3)
        del bad["model.norm.weight"]
    out["bad"] = _catch(scatter_full_state_dict, model, bad if rank == 0 else None)
    return out


def test_scatter_full_state_dict_pretrained_recipe():
    """Rank 0 holds the pretrained model and its state dict (taken before
    fully_shard); rank 1 builds on meta. After the scatter both hold the
    pretrained values (logits, rotary buffers). Rank 1 receives about its
    shards' bytes (not a whole model) and its live memory never reaches a
    whole model's."""
    world = 2
    results = run_distributed(world, scatter_pretrained, timeout=TIMEOUT)
    ref = _pretrained_llama()
    want = ref.state_dict()
    want_buffers = dict(ref.named_buffers())
    with torch.no_grad():
        logits = ref(input_ids=_hf.batch(1, 1)).logits
    full_bytes = sum(p.numel() * 4 for p in ref.parameters())
    for rank, res in enumerate(results):
        assert res["identity"]
        _assert_exact(res["values"], want, f"rank {rank}: ")
        _assert_exact(res["buffers"], want_buffers, f"rank {rank}: buffer ")
        torch.testing.assert_close(res["logits"], logits, atol=1e-5, rtol=0)
        assert "size mismatch for lm_head.weight" in res["bad"], res["bad"]
        assert 'Missing key(s) in state_dict: "model.norm.weight"' in res["bad"], res["bad"]
    res = results[1]
    print(f"rank 1: scatter received {res['received']} B, peak live {res['peak']} B; its "
          f"shards {res['local_bytes']} B; whole model {full_bytes} B")
    # its shards (+ padding), the rotary buffers and the pickled key/shape table
    assert res["local_bytes"] <= res["received"] <= res["local_bytes"] + 16384
    assert res["peak"] < 0.8 * full_bytes


# ===========================================================================
# 8. safetensors
# ===========================================================================
class _ReadRecorder:
    """Wraps ``safetensors.safe_open`` handles: elements read per key, and
    keys read whole (``get_tensor``)."""

    def __init__(self) -> None:
        self.elements: dict[str, int] = {}
        self.whole: list[str] = []

    def open(self, original):
        recorder = self

        class Slice:
            def __init__(self, key, piece):
                self.key, self.piece = key, piece

            def get_shape(self):
                return self.piece.get_shape()

            def __getitem__(self, index):
                rows = self.piece[index]
                recorder.elements[self.key] = recorder.elements.get(self.key, 0) + rows.numel()
                return rows

        class Handle:
            def __init__(self, *args, **kwargs):
                self.handle = original(*args, **kwargs)

            def keys(self):
                return self.handle.keys()

            def get_slice(self, key):
                return Slice(key, self.handle.get_slice(key))

            def get_tensor(self, key):
                recorder.whole.append(key)
                return self.handle.get_tensor(key)

        return Handle


def safetensors_load(files: list[str], bad_file: str, via_to_empty: bool) -> dict:
    import safetensors
    from tests._comm_counter import CollectiveCounter
    model = shard_blocks_and_root(_meta_lm())
    if via_to_empty:
        model.to_empty(device="cpu")  # load_safetensors also allocates meta shards itself
    reads, original = _ReadRecorder(), safetensors.safe_open
    safetensors.safe_open = reads.open(original)
    try:
        with CollectiveCounter() as comms:
            load_safetensors(model, files)
    finally:
        safetensors.safe_open = original
    values = _full_state(model)
    losses = _train_lm(model, "sgd", steps=1)
    bad = _catch(load_safetensors, model, bad_file)
    missing = _catch(load_safetensors, model, files[0])
    return {"values": values, "losses": losses, "bad": bad, "missing": missing,
            "collectives": sum(comms.counts.values()), "read": reads.elements,
            "local_numel": sum(p.numel() for p in model.parameters()),
            "read_whole": reads.whole}


@pytest.mark.parametrize("world,via_to_empty", [(2, False), (3, True)])
def test_load_safetensors(tmp_path, world, via_to_empty):
    from safetensors.torch import save_file
    torch.manual_seed(5)
    ref = TinyLM()  # not build_lm's seed: values no initialiser run would give
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    keys = sorted(sd)
    first, second = tmp_path / "part1.safetensors", tmp_path / "part2.safetensors"
    save_file({k: sd[k] for k in keys[: len(keys) // 2]}, str(first))
    save_file({k: sd[k] for k in keys[len(keys) // 2:]}, str(second))
    bad = dict(sd)
    bad["blocks.1.fc1.weight"] = torch.zeros(3, 7)
    save_file(bad, str(tmp_path / "bad.safetensors"))
    results = run_distributed(world, safetensors_load, [str(first), str(second)],
                              str(tmp_path / "bad.safetensors"), via_to_empty, timeout=TIMEOUT)
    # the same training on the reference from the same values
    losses = []
    opt = make_optim(ref.parameters(), "sgd")
    tokens, targets = token_batch(0, world * PER_RANK)
    loss = lm_loss(ref(tokens), targets)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    slack = sum(2 * (v[0].numel() if v.dim() > 1 else 1) for v in sd.values())
    read_total = {k: 0 for k in sd}
    for rank, res in enumerate(results):
        _assert_exact(res["values"], sd, f"rank {rank}: ")
        assert abs(res["losses"][0] - losses[0]) <= 1e-6, (res["losses"], losses)
        # no communication; only the rows that hold this rank's slice are read
        # (its slice of each parameter, rounded out to whole rows)
        assert res["collectives"] == 0
        assert res["read_whole"] == []  # TinyLM has no buffers; every parameter is managed
        assert sum(res["read"].values()) <= res["local_numel"] + slack, (rank, res["read"])
        for key, n in res["read"].items():
            read_total[key] += n
        assert "size mismatch for blocks.1.fc1.weight" in res["bad"], res["bad"]
        assert res["missing"].startswith("RuntimeError") and "Missing key" in res["missing"]
    # between them, the ranks read everything
    assert all(sd[k].numel() <= n for k, n in read_total.items()), read_total
