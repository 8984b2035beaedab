"""The validation machine and its ceilings: torch / triton / CUDA versions, the GPU, the measured
device-to-device copy bandwidth and dense bf16 matmul rate (every later ratio is taken against them),
and which optional Python packages are importable. Writes ``gpu_env.json``."""
from __future__ import annotations

import importlib.util
import os

import torch
from common import StepResults, environment, measure_ceilings, parser, pick_device

from megatron_cai.core import device as dev

OPTIONAL = ("numpy", "pytest", "sentencepiece", "tqdm", "transformers", "tokenizers", "tensorboard",
            "transformer_engine", "apex", "megatron.core")


def main(argv=None) -> int:
    args = parser(__doc__.split("\n\n")[0], "gpu_env", 30).parse_args(argv)
    device = pick_device(args.dry_run)
    env = environment(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(sm_count=props.multi_processor_count, memory_GiB=props.total_memory / 2**30,
                   cudnn=torch.backends.cudnn.version(), flash_sdp=torch.backends.cuda.flash_sdp_enabled())
        env["smem_optin"] = dev.kernel_limits(device)[1]
    modules = {m: importlib.util.find_spec(m.split(".")[0]) is not None for m in OPTIONAL}  # found, not imported
    res = StepResults(args.out, "Machine and ceilings", ["quantity", "value"], dry_run=args.dry_run,
                      environment=env, modules=modules)
    c = measure_ceilings(device, args.dry_run)
    res.set(ceilings=c)
    for k in ("device", "capability", "torch", "triton", "cuda", "python"):
        res.add({"quantity": k, "value": env.get(k)})
    for k, v in c.items():
        res.add({"quantity": k, "value": v})
    missing = [m for m, ok in modules.items() if not ok]
    res.add({"quantity": "missing optional packages", "value": ", ".join(missing) or "none"})
    if not modules["numpy"]:
        print("error: numpy is not importable: megatron_cai (core/device.py, the data pipeline) needs it")
    return res.finish(modules["numpy"])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
