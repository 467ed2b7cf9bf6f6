import sys
sys.path.insert(0, '.')
from tests.test_planner import *
from tests.test_planner import _label
import torch.distributed as dist

def worker():
    model = real_model("gpt")
    annotate(model, "finer", 4.0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    units = [state_of(m).unit for m in model.modules() if state_of(m) is not None and state_of(m).unit.modules[0] is m]
    log = []
    def probe(tag):
        def f(*_):
            live = [_label(model, u.modules) for u in units if any(b.is_unsharded or b.is_gathering for b in u.buffers)]
            log.append((tag, live))
        return f
    for name in ["blocks.3.mlp", "blocks.3.ln2", "ln_f", "head"]:
        m = model.get_submodule(name)
        m.register_full_backward_pre_hook(lambda *a, name=name: probe("pre-bwd " + name)())
        m.register_full_backward_hook(lambda *a, name=name: probe("post-bwd " + name)())
    for step in range(3):
        log.clear()
        loss_fn("gpt", step, dist.get_rank(), 2)(model).backward()
        optim.step(); optim.zero_grad()
    return log

def main():
    for tag, live in run_distributed(2, worker, timeout=120)[0]:
        print(tag, len(live), live)
if __name__ == "__main__":
    main()
