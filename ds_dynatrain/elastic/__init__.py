"""The elastic device manager's ground: the launch environment, the job's store keys, membership
generations, process groups built in the background and cached by member set, joiner placement,
requests from outside the job, and the launcher agent. Knows ``torch.distributed`` and the store,
never the engine or DeepSpeed.
"""
