"""Orchestration: the elastic engine and everything that changes the world under it.

``elastic_engine`` (``ElasticEngine``: DeepSpeed's overrides and the public API), ``build`` (the
first build or join in a worker), ``boundary`` (the step boundary and its vote, ``vote``),
``resize`` (a resize phase by phase), ``requests`` (requests from outside, prepared in the
background), ``join`` (the one joiner path, standby included), ``members`` (the next generation),
``header``, ``transfer``, ``pending``, ``construct``, ``loading``, ``lifecycle``, ``records``,
``state``. The only layer that knows both DeepSpeed's engine and the job's membership.
"""
