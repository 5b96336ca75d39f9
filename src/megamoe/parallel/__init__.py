"""The expert-parallel world (ranks, process group, launch) and symmetric memory."""
