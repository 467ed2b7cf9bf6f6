import sys
sys.path.insert(0, '.')
from tests.test_planner import *
from tests.test_planner import _train_and_measure
def main():
    model = meta_model("gpt")
    units = annotation(model, "finer")
    est = estimate_memory(model, 2, units=units, backend="gloo", bucket_cap_mb=4.0)
    est2 = estimate_memory(model, 2, units=units, backend="gloo", bucket_cap_mb=4.0, batch_fn=loss_fn("gpt", 0, 0, 2))
    ms = run_distributed(2, _train_and_measure, "gpt", "finer", 2, 4.0, timeout=120)
    print(est.buckets); print(est2.buckets); print(ms[0]["buckets"])
if __name__ == "__main__":
    main()
