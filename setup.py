"""Install with `pip install -e .` (install the CPU torch first: `pip install torch==2.13.0`)."""
from setuptools import find_packages, setup

setup(
    name="megatron-cai",
    version="0.1.0",
    description="Megatron-style GPT pretraining with Squinch 6-bit gradients, Z-Reg, visibility masks, "
    "dynamic-clamp QAT and Gumbel top-k distillation; runs on CPU (gloo) and GPU clusters (NCCL).",
    packages=find_packages(include=["megatron_cai", "megatron_cai.*"]),
    package_data={"megatron_cai.training.flags": ["megatron_core_flags.txt"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.5", "numpy", "sentencepiece", "tqdm"],
    extras_require={
        "tensorboard": ["tensorboard"],  # --tensorboard-dir (examples/slurm/pretrain_gpt_torchrun.sbatch)
        "test": [
            "pytest",
            "pytest-timeout",
            "tensorboard",
            "triton",
            "transformers",
            "tokenizers",
            "safetensors",
            "protobuf",
            "ruff",
            "matplotlib",
            "tiktoken",
            "regex",
        ],
        "gpu": ["triton"],
        "wandb": ["wandb"],  # --wandb-project (Weights & Biases logging)
        # Hugging Face export/import and the HF / GPT-2 BPE / tiktoken tokenizers
        "hf": ["transformers", "safetensors", "tokenizers", "protobuf", "tiktoken"],
    },
)
