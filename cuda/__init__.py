"""meshcomm.cuda: CUDA kernels (.cu beside this file) loaded at run time with CuPy.

CuPy is optional and imported lazily: `available()` says whether the kernels can run here.
`pack_cuda` / `unpack_cuda` take torch CUDA tensors or CuPy arrays with the signatures of
meshcomm.backends.pack's pack / unpack, which dispatch CUDA inputs here. `python -m
meshcomm.cuda.build --check` compiles every .cu with nvcc for sm_80 and sm_90.
"""
from __future__ import annotations

if __name__ == "cuda":
    # Imported as the top-level `cuda`: a checkout's root is on sys.path (`python -m pytest`
    # run there, say). That name belongs to NVIDIA's namespace package (cuda.bindings,
    # cuda.pathfinder, which CuPy imports), and a regular package of that name anywhere on
    # sys.path would hide it: be one more portion of that namespace instead, and nothing else.
    import pkgutil
    __path__ = pkgutil.extend_path(__path__, __name__)
else:
    from .kernels import (KernelUnsupported, available, pack_cuda, plan_boxes, unpack_cuda)

    __all__ = ["available", "pack_cuda", "unpack_cuda", "plan_boxes", "KernelUnsupported"]
