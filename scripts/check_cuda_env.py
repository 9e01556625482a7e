"""``make venv-cuda``'s last step: check that the CUDA environment holds what it should.

torch must be a CUDA build. The CUDA fbgemm-gpu links NVIDIA's driver libraries
(``libnvidia-ml.so.1``, ``libcuda.so.1``), so on a machine without the driver it installs but
cannot load: that is reported, not an error. Exit code 1 only for a wrong installation.
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch

    if not torch.version.cuda:
        print(f"venv-cuda: torch {torch.__version__} is not a CUDA build", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); GPUs visible: {torch.cuda.device_count()}")
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except OSError as exc:
        causes, e = [], exc
        while e is not None:  # fbgemm re-raises the loader's error as the cause of its own
            causes.append(str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
            e = e.__cause__ or e.__context__
        driver = [c for c in causes if "libnvidia-ml" in c or "libcuda" in c]
        if driver and torch.cuda.device_count() == 0:
            print(f"fbgemm-gpu (CUDA) is installed but loads only with NVIDIA's driver, which this machine "
                  f"lacks ({driver[0]})")
            return 0
        print(f"venv-cuda: fbgemm-gpu does not load: {exc}", file=sys.stderr)
        return 1
    print(f"fbgemm-gpu {fbgemm_gpu.__version__}, torchrec {torchrec.__version__}: loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
