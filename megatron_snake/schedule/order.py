"""Snake order: the micro-batch visiting order of each unit, the same in both sweeps."""


def snake_order(unit: int, num_microbatches: int) -> range:
    """Ascending for even units, descending for odd ones: the micro-batch that leaves a unit
    last is the first to enter the next unit."""
    if unit % 2 == 0:
        return range(num_microbatches)
    return range(num_microbatches - 1, -1, -1)
