"""data=custom: the user's own dataset, map-style or iterable, under every strategy.

# Note [custom data]
`data._target_` names a factory returning a torch `Dataset` (with `__len__`), a Hugging Face
`datasets.Dataset`, or an `IterableDataset`. Before any worker starts, the launching process builds it
once and reads its first sample (probe.py): the input and target fields (`data.input_key` /
`data.target_key`, or their defaults), the task and the sizes the built-in models read, and the input's
shape and dtype with the dataset's size (a DataSpec beside the config, Note [data spec] in
parallel/data/spec.py, which `example_input` hands the planner and the model checks). Workers receive
these resolved and build the dataset again each.

Map-style (loader.py): the order is a function of (seed, epoch): each epoch permutes the samples not
held out by `data.eval_fraction` (`data.shuffle=false`: the dataset's own order) and is cut into global
batches; an epoch's tail shorter than a global batch is dropped (no batch spans two epochs, no sample is
seen twice in one). Step k (from 1) takes the next global batch, and data-parallel rank r of d takes its
contiguous 1/d of it, so step k's global batch is the same on any world size and a run resumed at step k
continues with the batch of step k+1 whatever its world size. A torch DataLoader loads this rank's
indices of each step, from the step it starts at, in `data.workers` processes (`data.prefetch` batches
ahead each; 0 workers: in the training process), while the step trains.

Iterable (iterable.py), a stream that does not split (below): position p belongs to step p // B + 1 and,
within it, to rank (p mod B) // (B/d): ownership by position, so the global batch of step k is again the
same on any world size. Each rank reads the stream in order (in one loader process, or in this process with
0 workers) and keeps its own positions, collating only those. A stream with `state_dict()` /
`load_state_dict()` has its state after each step saved in checkpoints and resumes exactly there; any other
is resumed by reading and dropping the positions of the steps before. Reaching the end starts the stream
again (the next epoch, `set_epoch(e)` called when the dataset has it).

Split streams (split.py): a stream with `n_shards` = S > 1 and `shard(num_shards, index)` (a Hugging Face
datasets.IterableDataset has both; a torch IterableDataset may define them) is read in parts. Position p is
element p // S of shard p mod S (`shard(S, p mod S)`), each shard a cycle of its own: at its end it starts
again by itself, with its own epoch count and `set_epoch(e)` on that shard object. The order depends on
neither the world size nor data.workers. Rank r of d owns the positions p of each step with p mod d == r
(strided) and reads the shards s with s mod g == r mod g, g = gcd(d, S): only its own when d divides S
(each shard read by one rank), otherwise shared with d/g - 1 other ranks, which read them too and drop what
is not theirs (correct, not faster: a warning says so). Its loader workers take its shards in turn: the
m-th of them goes to worker m mod W', W' the largest divisor of the rank's shard count not above
data.workers (a log line says when W' < data.workers; 0: all in this process). Each worker yields, per
step, its shards' samples of the rank's positions in order; the DataLoader hands the items of an
iterable dataset's workers over in turn (worker 0, 1, ..., checked at each step), and this process puts
the parts back into position order: each worker collates its part and the rows are interleaved (torch's
default collation stacks samples; one shared tensor per sample would cost more than the samples), or,
with data.collate, the samples come as they are and are collated here. A shard object is iterated whole by the one worker
that owns it and must not split itself by `get_worker_info()` (a Hugging Face one would: it is read
through its `iter(batch_size=1)`, which does not). A stateful stream's state is one state per shard (its
own `state_dict()`, its element count and its epoch), taken after each step; at a checkpoint the ranks
gather theirs so data.pt holds every shard's, and a run on any world size resumes each shard from its
state. Without states, each shard is read from its start and the elements that the positions before the
resume point took are dropped, by the shard's reader only.
"""
from parallel.data.custom.dataset import Collate, build_dataset, is_iterable
from parallel.data.custom.evaluation import build_custom_eval
from parallel.data.custom.iterable import IterData
from parallel.data.custom.loader import MapData, MapOrder, split_indices
from parallel.data.custom.probe import check_custom, read_custom_hints

__all__ = ["Collate", "IterData", "MapData", "MapOrder", "build_custom_eval", "build_dataset", "check_custom", "is_iterable", "read_custom_hints",
           "split_indices"]
