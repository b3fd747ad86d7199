"""Run as `launch -m pkg.train_mod`: joins a gloo group and reports its rank."""
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
print(f"module rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
dist.destroy_process_group()
