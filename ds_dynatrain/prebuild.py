"""Build DeepSpeed's CPU communication op once, at install time.

DeepSpeed's CPU backend JIT-compiles a small C++ op (``deepspeed_shm_comm``) the first time a
process initialises ``deepspeed.comm``; it is cached afterwards. Building it once during
``make`` keeps that half-minute out of the first training job and the first test.
"""
from __future__ import annotations


def main() -> None:
    from deepspeed.comm.torch import build_shm_op
    build_shm_op()


if __name__ == "__main__":
    main()
