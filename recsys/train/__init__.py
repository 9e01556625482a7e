"""The trainer: loop, pipelining, DDP, checkpoints, logging, launch. ``python -m recsys.train``."""
