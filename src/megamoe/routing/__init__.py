"""Routing on the device: the pull schedule (which rows each rank pulls, grouped by expert) and its row tiles."""
