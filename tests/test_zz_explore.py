import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor
from tests.harness import run_distributed
from tests.test_placements import shard_with, _attr
from tests._training import build_model, global_batch, _local, make_optimizer
from fsdp_compose import clip_grad_norm_, param_norms

def explore(name):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model("gpt"); shard_with(model, name)
    opt = make_optimizer(model, "adamw")
    x, y = global_batch(0, world, "plain")
    model.loss(_local(x, rank, world), _local(y, rank, world)).backward()
    out = {}
    try:
        out["clip"] = clip_grad_norm_(model, 0.1).item()
        out["pn"] = {k: v.item() for k, v in param_norms(model).items()} if isinstance(param_norms(model), dict) else str(type(param_norms(model)))
    except Exception as e:
        out["clip_err"] = repr(e)
    opt.step()
    try:
        sd = model.state_dict()
        out["sd"] = {k: (type(v).__name__, tuple(v.shape), str(getattr(v, "placements", None))) for k, v in list(sd.items())[:4]}
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
        out["full_ok"] = True
    except Exception as e:
        import traceback; out["sd_err"] = traceback.format_exc()[-1500:]
    try:
        osd = opt.state_dict()
        out["osd"] = str(list(osd["state"].items())[0])[:300]
    except Exception as e:
        import traceback; out["osd_err"] = traceback.format_exc()[-1500:]
    return out

def test_explore():
    for name in ["rows", "owned", "shard1"]:
        r = run_distributed(2, explore, name)
        print(name, r[0])
