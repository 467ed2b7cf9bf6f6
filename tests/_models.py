"""Small models, data and helpers shared by ``test_real_code.py``,
``test_module_api.py``, ``test_late_parameters.py`` and ``test_kept_gradient.py``.

Shapes are deliberately uneven (width 7, hidden 15, vocabulary 97) so that
the flat buffers need padding and some ranks own none of a small parameter.
Every function that builds a model seeds torch itself, so a sharded run and
the single-process reference start from the same values.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_compose import fully_shard, param_info

VOCAB, D, HIDDEN, SEQ, OUT = 97, 7, 15, 5, 3
PER_RANK = 4  # samples per rank and step
SEED = 1234
ATOL = 1e-5


# ------------------------------------------------------------------ models
class MLPBlock(nn.Module):
    """A residual two-layer MLP on width ``D``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TinyLM(nn.Module):
    """Embedding, residual MLP blocks, a final ``norm`` and an ``lm_head``.
    ``forward(tokens, head=False)`` returns the ``norm`` output without
    calling ``lm_head`` (a torchtitan-style chunked loss calls the head itself)."""

    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, head: bool = True) -> torch.Tensor:
        h = self.tok_emb(tokens)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        return self.lm_head(h) if head else h

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self(tokens), targets)


class WithUnused(nn.Module):
    """``used`` (``Linear(d_in, d_out)``) is the whole forward; ``unused``
    (``Linear(d_in, d_unused)``) holds parameters no forward touches (for
    tests of units or parameters that get no gradient)."""

    def __init__(self, d_in: int, d_out: int, d_unused: int) -> None:
        super().__init__()
        self.used = nn.Linear(d_in, d_out)
        self.unused = nn.Linear(d_in, d_unused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class FeatureNet(nn.Module):
    """Float features in, ``OUT`` regression targets out."""

    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(n_blocks))
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build_lm(n_blocks: int = 2) -> TinyLM:
    torch.manual_seed(SEED)
    return TinyLM(n_blocks)


def build_features(n_blocks: int = 2) -> FeatureNet:
    torch.manual_seed(SEED)
    return FeatureNet(n_blocks)


def shard_blocks_and_root(model: nn.Module, **root_kw) -> nn.Module:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model, **root_kw)
    return model


# -------------------------------------------------------------------- data
def token_batch(step: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of ``SEQ`` random tokens and next-token-like targets."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    tokens = torch.randint(VOCAB, (n, SEQ), generator=g)
    targets = torch.randint(VOCAB, (n, SEQ), generator=g)
    return tokens, targets


def feature_batch(step: int, n: int, seed: int = 0, d_in: int = D,
                  d_out: int = OUT) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + step + 77)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


# -------------------------------------------------------------- optimizers
def make_optim(params: Iterable[nn.Parameter], name: str) -> torch.optim.Optimizer:
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


# ---------------------------------------------------------- reading values
def _attr(model: nn.Module, fqn: str) -> torch.Tensor:
    owner, _, name = fqn.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, name)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Runs on every rank of a sharded model: the full parameters, read
    through ``unshard(recurse=True)`` (compute dtype)."""
    names = [n for n, _ in model.named_parameters()]
    model.unshard(recurse=True)
    try:
        return {n: _attr(model, n).detach().clone() for n in names}
    finally:
        model.reshard(recurse=True)


def plain_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def grad_pieces(model: nn.Module) -> dict[str, Optional[tuple]]:
    """Runs on every rank: this rank's piece of every parameter's gradient
    as ``(local_offset, shape, grad)``, ``None`` where ``.grad`` is None.
    Uses only the public ``param_info``."""
    out: dict[str, Optional[tuple]] = {}
    for name, p in model.named_parameters():
        info = param_info(p)
        if p.grad is None:
            out[name] = None
        else:
            out[name] = (info.local_offset, tuple(info.shape), p.grad.detach().clone())
    return out


def assemble_grads(per_rank: list[dict[str, Optional[tuple]]]) -> dict[str, torch.Tensor]:
    """In the test process: full gradients from every rank's ``grad_pieces``
    (a parameter whose pieces are all None is left out)."""
    full: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple] = {}
    for pieces in per_rank:
        for name, piece in pieces.items():
            if piece is None:
                continue
            offset, shape, grad = piece
            shapes[name] = shape
            flat = full.setdefault(name, torch.full((torch.Size(shape).numel(),), float("nan"),
                                                    dtype=grad.dtype))
            if grad.numel():
                flat[offset:offset + grad.numel()] = grad.reshape(-1)
    return {n: f.view(shapes[n]) for n, f in full.items()}


def assert_dicts_close(got: dict, want: dict, atol: float = ATOL, what: str = "") -> float:
    assert got.keys() == want.keys(), f"{what}: names {sorted(got)} vs {sorted(want)}"
    worst = 0.0
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, f"{what}{name}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        diff = (g.double() - w.double()).abs().max().item() if w.numel() else 0.0
        assert diff <= atol, f"{what}{name} differs from the reference by {diff:.3g} (atol {atol})"
        worst = max(worst, diff)
    return worst


def assert_parity(results: list[dict], reference: dict, atol: float = ATOL) -> None:
    """Each rank's ``results[r]["params"]`` matches ``reference`` (and its
    ``losses`` if both have them)."""
    for rank, res in enumerate(results):
        for i, (got, want) in enumerate(zip(res.get("losses", []), reference.get("losses", []))):
            assert abs(got - want) <= atol, f"rank {rank}: loss of step {i} {got} vs {want}"
        assert_dicts_close(res["params"], reference["params"], atol, f"rank {rank}: parameter ")


def global_mean(value: torch.Tensor) -> float:
    """The mean of a scalar over the ranks (the global-batch loss)."""
    t = value.detach().to(torch.float64)  # float32 would round a float64 loss
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t.item()


def tiny_gpt(sharded: bool = True) -> nn.Module:
    """A seeded 3-block GPT (d=16, vocabulary 32, sequence 8), each block a
    unit and then the root when ``sharded``."""
    from fsdp_compose.testing import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=3))
    if sharded:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model
