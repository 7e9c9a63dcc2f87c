"""megatron_snake: SSD-offloaded LLM training as an extension of Megatron-Core.

torch is deliberately NOT an install requirement: pip would resolve an unpinned torch to
the newest CUDA build on a machine that has none, or replace a torch the user already has.
Install torch first (tools/install.sh does it only when torch is missing).
"""

import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Build the native modules when possible; a failed build falls back to Python: the
    I/O engine (_snake_aio, needs liburing) to Python I/O, the host AdamW update
    (_snake_adamw) to torch's kernels.

    Both take raw pointers and lengths and never link against torch, so one build serves
    every torch version.
    """

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure means "use the fallback"
            self._warn(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)

    @staticmethod
    def _warn(exc):
        sys.stderr.write(
            f"WARNING: a megatron_snake native module not built ({exc}); its fallback "
            "will be used (Python I/O, torch's AdamW). Install a C compiler (and "
            "liburing-dev for the I/O engine) to build it.\n"
        )


def native_extensions():
    if os.environ.get("SNAKE_NO_NATIVE") == "1":
        return []
    return [
        Extension(
            "megatron_snake._snake_aio",
            # the binding, the I/O engine and crc32c (one concern a file; engine.h and
            # crc32c.h are the C APIs the binding calls)
            sources=["csrc/snake_aio.c", "csrc/engine.c", "csrc/crc32c.c"],
            depends=["csrc/engine.h", "csrc/crc32c.h", "csrc/hidden.h"],
            libraries=["uring"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
        ),
        Extension(
            "megatron_snake._snake_adamw",
            # the one-pass host AdamW update: its own module so that it builds without
            # liburing. -ffp-contract=off: no multiply-add is fused but the ones that
            # reproduce torch's kernel (csrc/adamw.h); -fno-math-errno: sqrtf is the
            # instruction, as in torch
            sources=["csrc/snake_adamw.c", "csrc/adamw.c"],
            depends=["csrc/adamw.h", "csrc/hidden.h"],
            libraries=["m"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-ffp-contract=off",
                                "-fno-math-errno", "-pthread"],
            extra_link_args=["-pthread"],
        ),
    ]


setup(
    name="megatron_snake",
    version="0.1.0",
    description="SSD-offloaded LLM training (vertical schedule) on Megatron-Core",
    packages=find_packages(include=["megatron_snake", "megatron_snake.*"]),
    package_data={"megatron_snake.planner": ["profiles/*.json"]},
    python_requires=">=3.10",
    install_requires=[
        # the releases megatron_snake/releases.py lists, each tested (docs/megatron_lm.md);
        # a range, so that pip keeps the megatron-core a user has
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "packaging",
    ],
    extras_require={
        # --tensorboard-dir and --wandb-project (Megatron-LM's experiment tracking)
        "tracking": ["tensorboard", "wandb"],
        # --tokenizer-type GPT2BPETokenizer / HuggingFaceTokenizer / SentencePieceTokenizer
        # (none of them requires torch, so pip leaves the installed torch alone)
        "tokenizers": ["tokenizers", "sentencepiece", "transformers"],
        "dev": ["pytest>=7", "pytest-timeout", "matplotlib", "tensorboard", "wandb",
                "tokenizers", "sentencepiece", "transformers"],
        # tools/: plots of timelines and studies, and ZeRO-Infinity to compare with
        # (tools/install.sh --bench installs DeepSpeed against the torch that is here)
        "bench": ["matplotlib", "deepspeed==0.19.8"],
        # GPU-only, optional; the local layer spec and the native engine are the defaults.
        "gpu": ["transformer-engine[pytorch]", "kvikio-cu12", "nvidia-dali-cuda120"],
    },
    ext_modules=native_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
)
