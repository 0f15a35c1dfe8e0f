"""Tensor and data parallelism over torch.distributed (see docs/parallel.md).

`shard.py` slices each stage's weights for a rank (Megatron-style) and gives the
rank's `ModelConfig`; `comm.py` holds the process groups and the three collectives the
decoder's seam needs; `rank.py` wraps the executor for one rank; `launch.py` starts the
ranks through torch.distributed's elastic launcher. The job side lives above: a
rank's job driver in `offload.cli.parallel`, the data-parallel split and merge of a
job's requests in `offload.jobs.data_parallel`.
"""

from offload.parallel.shard import ShardSource, rank_config, split_sizes

__all__ = ["ShardSource", "rank_config", "split_sizes"]
