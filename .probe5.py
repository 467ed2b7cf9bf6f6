import sys
sys.path.insert(0, '.')
from tests.test_planner import *
from tests.test_planner import _label
import torch.distributed as dist
from fsdp_compose.runtime import scheduler as S

def worker(name, kind, cap):
    model = real_model(name)
    annotate(model, kind, cap)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = []
    orig = S.Scheduler._start_bucket
    def sb(self, issuer, unit, limited=False):
        before = self.inflight_all_gathers()
        bucket = self.buckets.of_unit(unit)
        members = None if bucket is None else [_label(model, m.modules) for m in bucket.gather_members(unit, issuer.training_state, {id(u) for u in self.forward_order})]
        r = orig(self, issuer, unit, limited)
        log.append((str(issuer.training_state), _label(model, issuer.modules), _label(model, unit.modules), limited, before, self.inflight_all_gathers(), members))
        return r
    S.Scheduler._start_bucket = sb
    for step in range(3):
        log.clear()
        loss_fn(name, step, dist.get_rank(), 2)(model).backward()
        optim.step(); optim.zero_grad()
    return log

def main():
    for e in run_distributed(2, worker, sys.argv[1], sys.argv[2], float(sys.argv[3]), timeout=120)[0]:
        print(*e)
if __name__ == "__main__":
    main()
