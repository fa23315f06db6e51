"""`python -m sglang.bench_serving`, runnable from a client-only SGLang install (`pip install --no-deps
sglang==0.5.23` plus the modules in requirements.txt):

    python scripts/sglang_bench_serving.py --backend sglang --port 30000 --dataset-name random-ids --num-prompts 64

Why a wrapper: sglang 0.5.23's bench_serving imports one string constant (FAKE_BOOTSTRAP_HOST, a bootstrap host
for prefill/decode disaggregation) from sglang.srt.disaggregation.utils, and that import loads SGLang's whole
serving runtime: model configs that need a torchvision built against the installed torch, apache-tvm-ffi, and
more. A client has none of it (with a CPU torch, PyPI's torchvision cannot even load). The wrapper provides that
one module with that one constant, then runs bench_serving unmodified.
"""

from __future__ import annotations

import runpy
import sys
import types


def main() -> None:
    utils = types.ModuleType("sglang.srt.disaggregation.utils")
    utils.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's value; used only by --fake-prefill
    sys.modules[utils.__name__] = utils
    sys.argv[0] = "sglang.bench_serving"
    runpy.run_module("sglang.bench_serving", run_name="__main__")


if __name__ == "__main__":
    main()
