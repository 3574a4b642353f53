"""Every test but the CUDA ones runs on the CPU, on a machine with GPUs too (tests/gpus.py, Note [tests on a GPU
machine]): this process, the zygote's runs and every CLI run see no GPU; a run that names trainer.device=cuda,
and a `gpus.call` child, see the machine's."""
import json
import os
import sys

import pytest
import torch

from tests import cli, gpus


def _machines() -> str | None:
    """CUDA_VISIBLE_DEVICES as the machine had it before the tests hid the GPUs (None: unset)."""
    return json.loads(os.environ[gpus.SAVED])


def test_this_process_and_every_run_on_the_cpu_see_no_gpu():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
    for args in ([], ["nproc=2", "strategy=data"], ["trainer.device=cpu"], ["trainer.device=auto"]):
        assert cli.env(args)["CUDA_VISIBLE_DEVICES"] == "", args
    assert cli._Zygote.env["CUDA_VISIBLE_DEVICES"] == ""


def test_a_cuda_run_sees_the_machines_gpus_and_never_goes_through_the_zygote():
    e = cli.env(["trainer.device=cuda", "nproc=2"])
    assert e.get("CUDA_VISIBLE_DEVICES") == _machines()
    assert cli.uses_gpus(["trainer.device=cuda"]) and not cli.uses_gpus(["trainer.device=cpu"])


@pytest.mark.parametrize("machine", [None, "", "0", "1,3"])
def test_hiding_and_giving_back_restore_the_machines_value(machine):
    e = {} if machine is None else {"CUDA_VISIBLE_DEVICES": machine}
    hidden = gpus.hidden(e)
    assert hidden["CUDA_VISIBLE_DEVICES"] == "" and gpus.hidden(hidden) == hidden  # hiding twice keeps the value
    back = gpus.with_gpus(hidden)
    assert back.get("CUDA_VISIBLE_DEVICES") == machine and gpus.with_gpus(e) == e


@pytest.mark.timeout(120)
def test_a_run_sees_no_gpu(tmp_path):
    """Through the zygote, or a new interpreter once a test has changed this process's environment."""
    script = tmp_path / "devices.py"
    script.write_text("import os, torch\nprint(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), "
                      "torch.cuda.is_available())\n")
    proc = cli.run_script(str(script), [], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.split() == ["''", "False"], proc.stderr


def sees(expected: str) -> None:
    """In a `gpus.call` child: CUDA_VISIBLE_DEVICES is the machine's (`expected`: its JSON)."""
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == json.loads(expected), os.environ.get("CUDA_VISIBLE_DEVICES")
    assert "tests" in sys.modules


def test_a_gpu_child_sees_the_machines_gpus():
    gpus.call(sees, json.dumps(_machines()))
    with pytest.raises(AssertionError, match="sees on the GPU exited 1"):
        gpus.call(sees, json.dumps("no such value"))
