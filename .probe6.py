import sys, collections
sys.path.insert(0, '.')
from tests.test_planner import *
import torch.distributed as dist
from fsdp_compose.buffers import staging as ST

def worker(name, kind, cap):
    model = real_model(name)
    annotate(model, kind, cap)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = []
    orig = ST.StagingPool.clear
    def clear(self):
        log.append(sorted(collections.Counter({n: len(v) for n, v in self._free.items()}).items()))
        orig(self)
    ST.StagingPool.clear = clear
    import os
    if os.environ.get("PRUNE"):
        from fsdp_compose.runtime import scheduler as S
        og = S.Scheduler.gather
        def gather(self, unit, prefetch):
            self.inflight_all_gathers()
            og(self, unit, prefetch)
        S.Scheduler.gather = gather
    for step in range(3):
        loss_fn(name, step, dist.get_rank(), 2)(model).backward()
        optim.step(); optim.zero_grad()
    return log

def main():
    name, kind, cap = sys.argv[1], sys.argv[2], float(sys.argv[3])
    for e in run_distributed(2, worker, name, kind, cap, timeout=120)[0]:
        print(e)
    from fsdp_compose.tools.planner import estimate as E
    model = meta_model(name)
    import fsdp_compose.tools.planner.simulation as SIM
    orig = SIM.Step._pool
    def pool(self, moments):
        most = {}
        for m in moments:
            count = {}
            for i in m.live:
                for size in self.plans[i].unsharded:
                    count[size] = count.get(size, 0) + 1
            for size, c in count.items():
                most[size] = max(most.get(size, 0), c)
        print("model pool", sorted(most.items()))
        return orig(self, moments)
    SIM.Step._pool = pool
    estimate_memory(model, 2, units=annotation(model, kind), backend="gloo", bucket_cap_mb=cap, split_root=kind=="split")
if __name__ == "__main__":
    main()
