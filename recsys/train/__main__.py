"""``python -m recsys.train`` / ``torchrun ... -m recsys.train``: one training process.

Reads top to bottom: parse → config → environment → trainer → train → close.
"""

from __future__ import annotations

import argparse
import json
import sys

from recsys.train.launch import add_job_arguments, run_dir_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recsys.train", description=__doc__)
    add_job_arguments(parser)
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from recsys.config import load_job, write_resolved
    from recsys.train.loop import Trainer, setup_env

    overrides = list(args.set) + ([f"train.device={args.device!r}"] if args.device else [])
    job = load_job(args.config, overrides)
    env = setup_env(job.train.device, job.train.collective_timeout_s)
    run_dir = run_dir_for(job, args.run_dir, env)
    if env.is_main:
        write_resolved(job, run_dir)
        print(f"run directory: {run_dir}", flush=True)
    trainer = Trainer(job, run_dir, env, resume=args.resume)
    try:
        result = trainer.train()
    finally:
        trainer.close()
    if env.is_main:
        (run_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result), flush=True)
        print(f"run directory: {run_dir}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
