"""Which checkpoint directory counts as complete, and which one `trainer.resume` takes (Note [atomic checkpoint])."""
import json

import pytest

from parallel.checkpoint import find, incomplete, newest_complete
from parallel.config import ConfigError


def fake(run_dir, step: int, sizes: dict[str, int] | None = None, sealed: bool = True):
    """A checkpoint directory whose files have the sizes its trainer.json lists (unless changed after)."""
    path = run_dir / "checkpoints" / f"step-{step:06d}"
    path.mkdir(parents=True)
    sizes = sizes or {".metadata": 10, "__0_0.distcp": 100}
    for name, size in sizes.items():
        (path / name).write_bytes(b"x" * size)
    if sealed:
        (path / "trainer.json").write_text(json.dumps({"step": step, "files": sizes}))
    return path


def test_complete_and_each_way_of_not_being(tmp_path):
    assert incomplete(fake(tmp_path, 1)) is None
    assert "no trainer.json" in incomplete(fake(tmp_path, 2, sealed=False))
    cut = fake(tmp_path, 3)
    (cut / "__0_0.distcp").write_bytes(b"x" * 40)
    assert incomplete(cut) == "__0_0.distcp holds 40 bytes of the 100 written (truncated)"
    gone = fake(tmp_path, 4)
    (gone / ".metadata").unlink()
    assert incomplete(gone) == ".metadata is missing"
    partial = fake(tmp_path, 5)
    partial = partial.rename(partial.with_name(partial.name + ".partial"))
    assert "unfinished" in incomplete(partial)
    bad = fake(tmp_path, 6)
    (bad / "trainer.json").write_text("{not json")
    assert "unreadable" in incomplete(bad)


def test_newest_complete_skips_newer_broken_ones(tmp_path):
    fake(tmp_path, 10)
    fake(tmp_path, 20)
    (fake(tmp_path, 30) / "__0_0.distcp").write_bytes(b"")
    fake(tmp_path, 100, sealed=False)  # numbers compare as numbers, not text
    path, skipped = newest_complete(tmp_path)
    assert path.name == "step-000020"
    assert [s.split("/")[-1].split(":")[0] for s in skipped] == ["step-000100", "step-000030"]


def test_resume_values(tmp_path):
    run = tmp_path / "run"
    assert find("auto", run) == (None, [])  # nothing yet: start at step 0
    first = fake(run, 4)
    assert find(str(run))[0] == first  # a run directory: its newest complete one
    assert find(str(first))[0] == first  # a checkpoint directory
    assert find("auto", run)[0] == first
    broken = fake(run, 8, sealed=False)
    assert find(str(run))[0] == first
    with pytest.raises(ConfigError, match=r"^trainer.resume=.*step-000008.*cannot be loaded: no trainer.json"):
        find(str(broken))  # a named checkpoint is not replaced by another
    with pytest.raises(ConfigError, match=r"^trainer.resume=.*no complete checkpoint"):
        find(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^trainer.resume=.*no such directory"):
        find(str(tmp_path / "nowhere"))


def test_a_ctrl_c_inside_dcp_stays_an_interrupt():
    """DCP gathers a rank's KeyboardInterrupt into a CheckpointException (a BaseException the workers' Ctrl-C
    handling would not see): it comes out as the interrupt again; any other failure stays DCP's."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from parallel.checkpoint import _interrupts_pass

    def failing(exc):
        try:
            raise exc
        except BaseException as e:  # noqa: BLE001 - what DCP's gathering does
            return _wrap_exception(e)

    with pytest.raises(KeyboardInterrupt), _interrupts_pass():
        raise CheckpointException("save", {0: failing(OSError("disk")), 1: failing(KeyboardInterrupt())})
    with pytest.raises(CheckpointException), _interrupts_pass():
        raise CheckpointException("save", {0: failing(OSError("disk full"))})
