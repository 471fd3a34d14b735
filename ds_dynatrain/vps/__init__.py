"""The Virtual Parameter Space: regions of logical tensors and the layouts that map ranks to them.

Pure: no process group, no engine. ``region`` (element intervals), ``layout`` (``ZeroLayout``:
ZeRO-1/2/3 fragments per rank from parameter metadata), ``affine`` (regions to and from
DeepSpeed's ``deepspeed.checkpoint.affine`` shard description, a pure data module of DeepSpeed).
"""

from .layout import DEFAULT_SUB_GROUP_SIZE, Fragment, ParamMeta, ZeroLayout, param_metas_from_groups
from .region import Region

__all__ = ["Region", "ZeroLayout", "ParamMeta", "Fragment", "param_metas_from_groups", "DEFAULT_SUB_GROUP_SIZE"]
