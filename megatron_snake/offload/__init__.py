"""What places training state in the tensor store (megatron_snake.storage): unit weights and
their gradients (unit_weights), unit inputs kept between the sweeps (unit_inputs, and
activation_plan, which places them by a lifetime-aware plan), and the tensors autograd saves
inside a unit (saved_tensors)."""
