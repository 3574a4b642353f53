"""Context parallelism on CUDA through PyTorch's own ring attention (Note [context parallelism on CUDA]).

# Note [context parallelism on CUDA]
On CUDA the attention over the cp ranks is PyTorch's (torch.distributed.tensor.experimental, the pieces of
`context_parallel` that TorchTitan uses): each attention's q, k, v become DTensors sharded on the sequence
dimension (dim 2 of (B, H, 2L, D)) over the cp mesh by `_ContextParallel`'s SDPA input hook, and
F.scaled_dot_product_attention on them runs, through the DTensor dispatcher that
`_enable_context_parallel_dispatcher` sets up, the ring version of the CUDA kernel SDPA picked (flash,
memory-efficient or cuDNN; the math kernel has no ring version, so it is left out with `sdpa_kernel`). Options:
load balancing on (causal attention, `_cp_options.enable_load_balance`), keys and values exchanged with one
all-gather (`set_rotate_method("allgather")`, torch's default, the same exchange as the CPU path's), the
gradients of keys and values passed round the ring with all-to-all (torch's fixed choice).

Kernel rows. The memory-efficient kernel (fp32 on CUDA) returns its log-sum-exp padded to a multiple of 32
rows (torch/_meta_registrations.py), and torch's merge broadcasts it against the output, whole and by halves:
each chunk must be whole rows of 32 in fp32 (checked before the run); the flash (bf16) and cuDNN kernels return
one row per token. The dispatcher is process-wide: it would send any SDPA on DTensors to the ring, and nothing
else here calls SDPA on DTensors (the tensor plan hands attention local q, k, v).

Layout. torch's load balancer (`_HeadTailLoadBalancer`) reorders a sequence of 2 x cp chunks as chunk 0,
2cp-1, 1, 2cp-2, ... and `Shard(seq_dim)` gives rank r the r-th piece: chunks r and 2cp-1-r, in that order,
which is the CPU path's layout (Note [context parallelism] in attention.py). The positions here are read off
torch's own indices all the same, so inputs, targets and `position_ids` follow torch's layout by construction
(tests/unit/test_context.py checks the two layouts agree).

What was checked, with no GPU where this was written (torch 2.13):
  run on the CPU   torch's ring attention itself (`_templated_ring_attention` and its backward, load-balanced,
                   all-gather and all-to-all over gloo) on TorchSequenceShard's chunks, with the CPU's flash
                   kernel standing in for CUDA's: outputs and q, k, v gradients equal whole-sequence causal
                   attention (tests/distributed/test_context.py); the layouts agree (tests/unit/test_context.py);
                   `attend` wraps q, k, v as DTensors without a module and reaches torch's dispatcher (which on
                   the CPU stops at its flash kernel, "no sharding strategy registered").
  read only        that SDPA on those DTensors reaches the ring version of the CUDA kernels through the
                   dispatcher, that the dispatcher, left on, serves the backward kernels too, and the 32 rows.
  not run          training on GPUs (tests/distributed/test_cuda.py: cp 2 vs single, skipped without two CUDA
                   devices); trainer.compile with cp on CUDA is a config error (check_context).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental._attention import (
    _ContextParallel,
    _cp_options,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    set_rotate_method,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from parallel.strategies.context.attention import SequenceShard

# The kernels with a ring version in torch's context parallelism (the math kernel has none).
RING_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
SEQ_DIM = 2  # q, k, v are (B, H, T, D); torch's ring attention assumes dim 2
_STYLE = _ContextParallel(seq_dim=SEQ_DIM, attention_type=_ContextParallel.AttentionType.SDPA)


def enable_torch_context_parallel() -> None:
    """Route SDPA on sequence-sharded DTensors to torch's ring attention, load-balanced, keys and values
    all-gathered (Note [context parallelism on CUDA]). Process-wide; torch keeps it registered once."""
    _cp_options.enable_load_balance = True
    set_rotate_method("allgather")
    _enable_context_parallel_dispatcher()


class TorchSequenceShard(SequenceShard):
    """This rank's chunks of every sequence in torch's load-balanced layout, and causal attention through
    torch's ring attention (Note [context parallelism on CUDA]).

    Args:
        cp: the context-parallel degree.
        rank: this rank's place in the cp group.
        group: the cp process group.
        mesh: the one-dimensional cp mesh (None only where no attention runs, as in a layout check).
    """

    def __init__(self, cp: int, rank: int, group=None, mesh: DeviceMesh | None = None):
        super().__init__(cp, rank, group)
        self.mesh = mesh

    def positions(self, length: int, device=None) -> torch.Tensor:
        order = _HeadTailLoadBalancer(length, self.cp, device or "cpu")._generate_indices()[0]
        return order.long().chunk(self.cp)[self.rank]  # Shard(seq_dim): the rank-th equal piece

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence: q, k, v (B, H, 2L, D) local, k and v
        with as many heads as q."""
        args, kwargs = _STYLE.sdpa_input_fn(None, (q, k, v), {"is_causal": True, "scale": scale}, self.mesh)
        with sdpa_kernel(RING_KERNELS):
            out = F.scaled_dot_product_attention(*args, **kwargs)
        return _STYLE.sdpa_output_fn(None, None, out, self.mesh)
