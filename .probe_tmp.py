import sys, time
sys.path.insert(0, '.')
from tests.test_planner import *
from tests.test_planner import _train_and_measure
from tests.harness import run_distributed
def main():
    for name, kind, cap in [("many","blocks",MANY_CAP), ("many","split",MANY_CAP), ("gpt","blocks",4.0), ("gpt","finer",4.0), ("llama","blocks",4.0)]:
        model = meta_model(name)
        units = annotation(model, kind)
        o = dict(units=units, backend="gloo", bucket_cap_mb=cap, split_root=kind == "split")
        est = estimate_memory(model, 2, **o)
        unb = estimate_memory(model, 2, **(o | {"bucket_cap_mb": 0}))
        t=time.time()
        ms = run_distributed(2, _train_and_measure, name, kind, 3, cap, timeout=120)
        print(name, kind, cap, "%.1fs"%(time.time()-t), "buckets", len(est.buckets), ms[0]["buckets"] == list(est.buckets))
        print("  est state_peak", est.state_peak, "total", est.total_peak, "staging", est.peak_parts.comm_staging, est.peak_at, "| unbucketed", unb.state_peak)
        for m in ms:
            print("  meas peak_no_comm", m["peak_no_comm"], "%+.2f%%" % (100*(m["peak_no_comm"]/est.state_peak-1)), "peak-comm", m["peak"]-m["comm_at_peak"], "%+.2f%%" % (100*((m["peak"]-m["comm_at_peak"])/(est.total_peak-est.peak_parts.comm_staging)-1)), "comm", m["comm_at_peak"])
    

if __name__ == "__main__":
    main()