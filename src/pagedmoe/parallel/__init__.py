"""Tensor and expert parallelism (issue 24): one process per rank, the scheduler on rank 0.

state.py    the process's rank, world size and groups; the all-reduce the sharded layers call
sharding.py one rank's ModelDims / ArchSpec and the slice of a checkpoint tensor it holds
launch.py   start-up of the ranks (spawned workers or torchrun), the worker loop, shutdown
"""
