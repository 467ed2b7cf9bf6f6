import sys
sys.path.insert(0, '.')
from tests.test_planner import *
from tests.test_planner import _label
import torch.distributed as dist
from fsdp_compose.runtime import scheduler as S

def worker():
    model = real_model("gpt")
    annotate(model, "finer", 4.0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    units = [state_of(m).unit for m in model.modules() if state_of(m) is not None and state_of(m).unit.modules[0] is m]
    log = []
    orig = S.Scheduler.gather
    def gather(self, unit, prefetch):
        pre = self.inflight_all_gathers(), [[b.records[0].fqn for b in g if b.is_gathering] for g in self._gathers], [_label(model, t.modules) for t in prefetch]
        orig(self, unit, prefetch)
        log.append(("pre", pre))
        filled = [(_label(model, u.modules), b.is_gathering, b.is_unsharded, b.unsharded.untyped_storage().nbytes()) for u in units for b in u.buffers if _label(model, u.modules) in ('blocks.3.ln2', 'blocks.2.mlp', 'tok_emb', 'blocks.3.mlp')]
        log.append((str(unit.training_state), _label(model, unit.modules), filled))
    S.Scheduler.gather = gather
    for step in range(3):
        log.clear()
        loss_fn("gpt", step, dist.get_rank(), 2)(model).backward()
        optim.step(); optim.zero_grad()
    return log

def main():
    for e in [x for r in run_distributed(2, worker, timeout=120) for x in r]:
        print(*e)
if __name__ == "__main__":
    main()
