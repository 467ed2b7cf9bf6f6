import sys, collections
sys.path.insert(0, '.')
import tests.test_planner as tp
from tests.test_planner import *

def worker(name, kind, cap):
    # capture the live set at the peak of step 2
    orig = tp._timeline
    captured = {}
    def timeline(prof, saved):
        out, phases = orig(prof, saved)
        events = []
        for node in tp._walk(prof.profiler.kineto_results.experimental_event_tree()):
            f = node.extra_fields
            if isinstance(f, torch._C._profiler._ExtraFields_Allocation):
                par = node.parent
                names = []
                while par is not None and len(names) < 4:
                    names.append(par.name); par = par.parent
                if not tp._in_comm(node):
                    events.append((node.start_time_ns, f.alloc_size, f.ptr, "<".join(names)))
        events.sort(key=lambda e: e[0])
        start, end = phases["step2"]
        # peak in step2 of total
        live = {}; best = (-1, None); tot = 0
        for t, size, ptr, nm in events:
            if size > 0: live[ptr] = (size, nm)
            else: live.pop(ptr, None)
            tot += size
            if start <= t <= end and tot > best[0]:
                best = (tot, dict(live), nm)
        captured["peak"] = best[0]
        c = collections.Counter()
        for size, nm in best[1].values():
            c[(size, nm[:150])] += 1
        captured["live"] = sorted(c.items(), key=lambda kv: -kv[0][0]*kv[1])[:25]
        captured["at"] = best[2]
        return out, phases
    tp._timeline = timeline
    r = tp._train_and_measure(name, kind, 3, cap)
    r["cap"] = captured
    return r

def main():
    name, kind, cap = sys.argv[1], sys.argv[2], float(sys.argv[3])
    model = meta_model(name)
    est = estimate_memory(model, 2, units=annotation(model, kind), backend="gloo", bucket_cap_mb=cap, split_root=kind=="split")
    print(est)
    ms = run_distributed(2, worker, name, kind, cap, timeout=120)
    m = ms[0]
    print("peak_no_comm", m["peak_no_comm"], "total peak incl acts", m["cap"]["peak"], "at", m["cap"]["at"])
    for (size, nm), n in m["cap"]["live"]:
        print(f"{size:>10} x{n}  {nm}")
if __name__ == "__main__":
    main()
