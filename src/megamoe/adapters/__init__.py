"""Drop-ins for the training stacks people use.

- :mod:`megamoe.adapters.hf`: HuggingFace transformers' sparse MoE blocks on megamoe (``patch``).
- :mod:`megamoe.adapters.torchtitan`: torchtitan's MoE layers on megamoe (``patch``).
- :mod:`megamoe.adapters.fsdp`: EP inside a (dp, ep) DeviceMesh, FSDP2 across it (``mesh``, ``shard``).

Each is imported on its own (``import megamoe.adapters.hf``); none imports its stack at import time.
"""
