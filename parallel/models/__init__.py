"""Built-in reference models, picked by name from an explicit registry."""
from parallel.models.cnn import build_cnn
from parallel.models.gpt import build_gpt
from parallel.models.local import build_local
from parallel.models.mlp import build_mlp
from parallel.models.moe import build_moe
from parallel.models.stacked import build_stacked

MODELS = {
    "mlp": build_mlp,
    "gpt": build_gpt,
    "cnn": build_cnn,
    "stacked": build_stacked,
    "local": build_local,
    "moe": build_moe,
}
