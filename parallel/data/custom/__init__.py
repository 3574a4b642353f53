"""data=custom: the user's own dataset, map-style or iterable, under every strategy.

# Note [custom data]
`data._target_` names a factory returning a torch `Dataset` (with `__len__`), a Hugging Face
`datasets.Dataset`, or an `IterableDataset`. Before any worker starts, the launching process builds it
once and reads its first sample (probe.py): the input and target fields (`data.input_key` /
`data.target_key`, or their defaults), the task and the sizes the built-in models read, and the input's
shape and dtype (`data.spec`, which `example_input` hands the planner and the model checks). Workers
receive these resolved and build the dataset again each.

Map-style (loader.py): the order is a function of (seed, epoch): each epoch permutes the samples not
held out by `data.eval_fraction` (`data.shuffle=false`: the dataset's own order) and is cut into global
batches; an epoch's tail shorter than a global batch is dropped (no batch spans two epochs, no sample is
seen twice in one). Step k (from 1) takes the next global batch, and data-parallel rank r of d takes its
contiguous 1/d of it, so step k's global batch is the same on any world size and a run resumed at step k
continues with the batch of step k+1 whatever its world size. A torch DataLoader loads this rank's
indices of each step, from the step it starts at, in `data.workers` processes (`data.prefetch` batches
ahead each; 0 workers: in the training process), while the step trains.

Iterable (iterable.py): the stream's position p belongs to step p // B + 1 and, within it, to rank
(p mod B) // (B/d): ownership by position, so the global batch of step k is again the same on any world
size. Each rank reads the stream in order (in one loader process, or in this process with 0 workers) and
keeps its own positions, collating only those. A stream with `state_dict()` / `load_state_dict()` has its
state after each step saved in checkpoints and resumes exactly there; any other is resumed by reading
and dropping the positions of the steps before. Reaching the end starts the stream again (the next
epoch, `set_epoch(e)` called when the dataset has it).
"""
from parallel.data.custom.dataset import Collate, build_dataset, is_iterable
from parallel.data.custom.evaluation import build_custom_eval
from parallel.data.custom.iterable import IterData
from parallel.data.custom.loader import MapData, MapOrder, split_indices
from parallel.data.custom.probe import check_custom, read_custom_hints

__all__ = ["Collate", "IterData", "MapData", "MapOrder", "build_custom_eval", "build_dataset", "check_custom", "is_iterable", "read_custom_hints",
           "split_indices"]
