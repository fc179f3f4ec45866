"""fastgrpo: a kernel-centric, single-node GRPO trainer.

The top-level ``kernels/`` folder is installed as ``fastgrpo.kernels`` (never as a top-level ``kernels``
package: another PyPI distribution owns that name and transformers probes for it).
"""

from setuptools import find_packages, setup

setup(
    name="fastgrpo",
    version="0.1.0",
    description="Kernel-centric single-node GRPO trainer: fused Triton losses, packed attention, co-located generation",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # the subpackages (fastgrpo.engine, .algorithms, ...) by search: a wheel built from an explicit list that misses
    # one installs a package that cannot import
    packages=["fastgrpo", *(f"fastgrpo.{p}" for p in find_packages("fastgrpo")), "fastgrpo.kernels"],
    package_dir={"fastgrpo": "fastgrpo", "fastgrpo.kernels": "kernels"},
    package_data={"fastgrpo": ["recipes/*.yaml"]},
    install_requires=[
        "torch>=2.6",
        "triton>=3.2; platform_system == 'Linux'",
        "transformers>=5.0",
        "safetensors",
        "tokenizers",
        "numpy",
        "pyyaml",
        "math-verify>=0.7",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        # trl: tests/test_trl_dropin.py (the README's GRPOTrainer subclass) and TRL's overlong-punishment numbers;
        # it accepts any torch >= 2.0, so pip keeps the CPU torch installed first
        # peft: LoRA (model.lora, fastgrpo/models/lora.py) and its tests
        "test": ["pytest", "pytest-benchmark", "hypothesis", "ruff", "tensorboard", "trl>=1.16", "peft>=0.17"],
        "lora": ["peft>=0.17"],
        # peer baselines of the microbenchmarks (bench/micro_*.py skip a peer that is not installed); install the
        # torch build you want first: both accept any torch >= 2.1, so pip keeps it
        "bench": ["liger-kernel>=0.8", "trl>=1.16"],
    },
)
