"""The DeepSpeed bridge: the only package that reads or writes DeepSpeed's ZeRO internals.

``geometry`` (the ZeRO optimizer, its partitions, the layout a live engine has), ``state`` (fp32
master and optimizer state out and in), ``rebuild`` (detach an engine, rebuild it in place with
less work), ``zero3`` (ZeRO-3 parameters gathered whole and released), ``comm`` (DeepSpeed's
cached comm state across generations).
"""
