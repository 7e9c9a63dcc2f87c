"""The main module of a process a run of the runner spawns (multiprocessing's spawn start
method: megatron-core's torch_dist checkpoint writer).

A spawned process imports its parent's main module again before it runs its task; for a
script that would run the script's imports again (``pretrain_gpt.py`` imports
``megatron.training``) without the plug-in installed: without triton, Megatron-LM 0.16's
``megatron.training`` does not import there. The runner names this module as the script's
main module (``__main__.__spec__``), so such a process imports megatron_snake, whose import
prepares megatron-core's (``compat.megatron_import``), and nothing of the script.
"""
