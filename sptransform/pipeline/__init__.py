"""Pipeline parallelism: plan (boundaries, costs, balance), schedules, stages, the pipelined module."""
