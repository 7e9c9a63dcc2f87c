"""Experiment tracking: Megatron-LM's ``--tensorboard-dir`` and ``--wandb-*`` flags.

The train log hands each iteration's scalars (and each log interval's) to ``Trackers``,
which writes them to TensorBoard and/or Weights & Biases under Megatron-LM's scalar names
("lm loss", "learning-rate", "grad-norm", "throughput", ...) plus this project's own under
``snake/`` (bytes per tier, I/O wait, overlap). Rank 0 writes, the rank that prints the log
(the loss it logs is already reduced over the pipeline and data-parallel ranks).

The directories are made 0755, or taken when no user outside the owner's group can write
them, so no one else can plant a link where the writers create their files.

Both libraries are optional (``pip install -e .[tracking]``); a flag whose library is
missing is refused when the flags are checked, before any work is done.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import stat

TRACKING_LIBRARIES = {"--tensorboard-dir": "tensorboard", "--wandb-project": "wandb"}


def check_tracking_args(args: argparse.Namespace) -> None:
    """One clear error for a tracking flag that cannot work; raises ValueError."""
    for flag, module in TRACKING_LIBRARIES.items():
        if getattr(args, flag[2:].replace("-", "_")) and importlib.util.find_spec(module) is None:
            raise ValueError(f"{flag} needs the {module} package, which is not installed: "
                             f"pip install {module} (or pip install -e .[tracking])")
    if not args.wandb_project:
        for flag in ("--wandb-exp-name", "--wandb-save-dir"):
            if getattr(args, flag[2:].replace("-", "_")):
                raise ValueError(f"{flag} configures Weights & Biases logging; add "
                                 "--wandb-project NAME or drop the flag")
    for flag in ("--tensorboard-dir", "--wandb-save-dir"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path and os.path.islink(path):
            raise ValueError(f"{flag} {path!r} is a symbolic link; the run writes only into "
                             "a directory of its own: give the real path")
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {path!r} is a file; give a directory (it is created "
                             "when missing)")


def own_dir(path: str, flag: str) -> None:
    """``path`` made (parents too, mode 0755), or an existing real directory that users
    other than its owner's group cannot write (no one else can plant a link where the
    writers create their files). An existing directory's mode is left as it is."""
    try:
        os.makedirs(path, mode=0o755)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{flag} {path!r} is not a real directory (a link or a file); give "
                         "a directory")
    if st.st_mode & stat.S_IWOTH:
        raise ValueError(f"{flag} {path!r} is writable by every user: anyone could plant a "
                         "link where the run writes; give a directory of your own")


class Trackers:
    """The TensorBoard writer and the wandb run of this rank (none on other ranks)."""

    def __init__(self, args: argparse.Namespace, *, writes: bool):
        self.tensorboard = self.wandb_run = None
        if not writes:
            return
        try:
            self._open(args)
        except BaseException:
            self.close()          # the writer opened before a failing wandb.init
            raise

    def _open(self, args) -> None:
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            own_dir(args.tensorboard_dir, "--tensorboard-dir")
            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=1000)
        if args.wandb_project:
            import wandb

            save_dir = args.wandb_save_dir or os.path.join(args.save or ".", "wandb")
            own_dir(save_dir, "--wandb-save-dir")
            # WANDB_MODE=offline (tests, machines without network) is honoured by wandb
            self.wandb_run = wandb.init(project=args.wandb_project, name=args.wandb_exp_name,
                                        dir=save_dir, config=_plain_config(args))

    @property
    def active(self) -> bool:
        return self.tensorboard is not None or self.wandb_run is not None

    def write(self, scalars: dict, iteration: int) -> None:
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, iteration)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=iteration)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _plain_config(args: argparse.Namespace) -> dict:
    """The flags as wandb's run config: only values it can store as they are."""
    return {k: v for k, v in vars(args).items()
            if isinstance(v, (bool, int, float, str)) or v is None}
