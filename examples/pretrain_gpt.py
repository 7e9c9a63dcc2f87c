"""Pretrain a Megatron-Core GPT. With --snake-offload, megatron_snake's vertical schedule.

    python examples/pretrain_gpt.py --snake-offload            # tiny demo GPT on mock data
    python examples/pretrain_gpt.py --help                     # every flag and its default
    torchrun --nproc-per-node 2 examples/pretrain_gpt.py ...   # data parallel
    torchrun --nproc-per-node 4 examples/pretrain_gpt.py --snake-offload \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --snake-offload-dir '/nvme/{local_rank}'
                                                               # see docs/multinode.md
"""

import sys
import warnings

# Megatron-Core warns at import that Transformer Engine / Apex are missing; the local
# implementations it falls back to are what runs here.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")
warnings.filterwarnings("ignore", message="full scope is deprecated")

from megatron_snake import releases  # noqa: E402
from megatron_snake.errors import UserError, debugging, report  # noqa: E402

try:   # before anything of megatron-core is imported: another release may not import at all
    releases.check_installed_megatron_core()
except UserError as exc:
    sys.exit(report(exc, prog="pretrain_gpt.py"))

from megatron_snake.training.arguments import parse_args  # noqa: E402
from megatron_snake.training.distributed import shutdown  # noqa: E402
from megatron_snake.training.loop import pretrain  # noqa: E402


def main(argv=None) -> int:
    """Exit status 0; 2 for a flag refused (argparse's usage error); 1 for a run refused
    because of its input, printed as one line (SNAKE_DEBUG=1: with its traceback)."""
    args = parse_args(argv)
    try:
        pretrain(args)
    except UserError as exc:
        if debugging():
            raise
        return report(exc, prog="pretrain_gpt.py")
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
