"""`megamoe train`: a small HuggingFace Qwen3-MoE decoder trained end to end, expert parallel over a megamoe
world, its MoE blocks run by a chosen implementation, on deterministic synthetic data.

    record = train(TrainOptions(preset="cpu", impls=("megamoe", "reference"), steps=12, ranks=2))

``model`` builds the model (presets), ``data`` the synthetic tokens, ``loop`` the training loop and its
gradient reduction, ``memory`` whether a run fits its device (asked before it starts), ``report`` the table, the
JSON record and the loss plot.
"""

from megamoe.training.data import MarkovTokens
from megamoe.training.loop import TrainOptions, reduce_gradients, train, train_rank
from megamoe.training.model import PRESETS, TrainPreset, build_model, get_preset
from megamoe.training.report import format_table, plot_losses, plot_unavailable, write_json

__all__ = ["PRESETS", "MarkovTokens", "TrainPreset", "TrainOptions", "build_model", "format_table", "get_preset",
           "plot_losses", "plot_unavailable", "reduce_gradients", "train", "train_rank", "write_json"]
