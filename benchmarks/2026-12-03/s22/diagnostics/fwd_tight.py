import time, torch, statistics, logging
torch.set_num_threads(2)
from hf_dspark.loading import load_target
from hf_dspark.cpu_kernels import loop_linears
from hf_dspark.scheduling.step_cost import prefill_context
from transformers import DynamicCache
logging.basicConfig(level=logging.WARNING)
target, tok = load_target(None)
g = torch.Generator().manual_seed(0)
for kernel in (True, False):
    with torch.inference_mode(), loop_linears(kernel, target, None):
        cache = prefill_context(target, 256, device=torch.device("cpu"), generator=g)
        ts = []
        for i in range(30):
            ids = torch.randint(0, 1000, (1, 1))
            t = time.perf_counter()
            target(input_ids=ids, position_ids=torch.tensor([[256 + i]]), cache=cache, use_cache=True, logits_to_keep=1)
            ts.append(time.perf_counter() - t)
        ts = ts[2:]
        print("skinny" if kernel else "stock", "min %.1f median %.1f" % (1000 * min(ts), 1000 * statistics.median(ts)))
