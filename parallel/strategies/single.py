"""strategy=single: one process, one device; the reference every strategy is compared to."""
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.config import Config
from parallel.runtime import Runtime


def apply_single(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime) -> nn.Module:
    """Leave the model as it is."""
    return model
