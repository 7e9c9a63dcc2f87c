"""The cost model of a training step (pure Python: importable without torch).

``workload.Workload`` says what a step asks of each rank, ``hardware.Hardware`` what a node
offers, and ``cost.predict`` the step time, its breakdown per resource and the bytes per
tier. ``megatron_snake.training.workload`` builds the workload from pretrain_gpt.py's
flags (that part needs torch). tools/plan.py is the command line; tools/calibrate.py measures a profile.
"""

from megatron_snake.planner.cost import DoesNotFit, Prediction, predict
from megatron_snake.planner.hardware import Hardware, load_profile
from megatron_snake.planner.workload import Stage, Workload, layer_flops_per_token

__all__ = ["DoesNotFit", "Hardware", "Prediction", "Stage", "Workload",
           "layer_flops_per_token", "load_profile", "predict"]
