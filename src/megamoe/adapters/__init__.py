"""Drop-ins for the training stacks people use: :mod:`megamoe.adapters.hf` (HuggingFace transformers).

Each adapter is imported on its own (``import megamoe.adapters.hf``): none imports its stack at import time.
"""
