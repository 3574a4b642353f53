"""The learning-rate schedules (Note [lr schedule]): values at chosen steps, a torch scheduler class, resume."""
import pytest
import torch

from parallel.config import Config, ConfigError, OptimConfig
from parallel.lr_schedule import build_scheduler, check_schedule, group_settings, lr_factor, restore_scheduler
from parallel.optim import check_optim


def optim(**kw) -> OptimConfig:
    o = OptimConfig(min_lr_ratio=0.1)
    for k, v in kw.items():
        setattr(o, k, v)
    return o


# (schedule settings, trainer.steps, {optimizer steps taken: factor})
VALUES = [
    (dict(schedule="constant", warmup_steps=4), 10, {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 9: 1.0}),
    (dict(schedule="cosine"), 10, {0: 1.0, 5: 0.55, 10: 0.1, 12: 0.1}),
    (dict(schedule="cosine", warmup_steps=2, min_lr_ratio=0.0), 12, {0: 0.5, 2: 1.0, 7: 0.5, 12: 0.0}),
    (dict(schedule="linear", warmup_steps=2, min_lr_ratio=0.0), 10, {0: 0.5, 1: 1.0, 2: 1.0, 6: 0.5, 10: 0.0}),
    (dict(schedule="linear"), 10, {0: 1.0, 5: 0.55, 10: 0.1}),
    # wsd: warmup 2, stable until 20 - 5 = 15, then linear to 0.1 at 20
    (dict(schedule="wsd", warmup_steps=2, decay_steps=5), 20, {0: 0.5, 1: 1.0, 14: 1.0, 15: 1.0, 17: 0.64, 20: 0.1}),
    # wsd with the decay a fraction of the run: 0.25 x 8 = 2 steps, from 6
    (dict(schedule="wsd", decay_fraction=0.25), 8, {0: 1.0, 5: 1.0, 6: 1.0, 7: 0.55, 8: 0.1}),
]


@pytest.mark.parametrize("settings,steps,values", VALUES)
def test_schedule_values_at_chosen_steps(settings, steps, values):
    o = optim(**settings)
    for step, want in values.items():
        assert lr_factor(o, steps, step) == pytest.approx(want, abs=1e-12), (step, want)


def sgd_groups(lr: float = 0.1) -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": lr / 2}], lr=lr)


def test_built_in_schedule_scales_every_group():
    cfg = Config()
    cfg.optim = optim(schedule="linear", lr=0.1, min_lr_ratio=0.0)
    cfg.trainer.steps = 4
    opt = sgd_groups()
    sched = build_scheduler(opt, cfg.optim, cfg.trainer.steps)
    seen = []
    for _ in range(4):
        seen += [g["lr"] for g in opt.param_groups]
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.05, 0.075, 0.0375, 0.05, 0.025, 0.025, 0.0125])


def test_scheduler_class_from_config():
    cfg = Config()
    cfg.optim.lr = 0.1
    cfg.optim.scheduler._target_ = "torch.optim.lr_scheduler.StepLR"
    cfg.optim.scheduler.args = {"step_size": 2, "gamma": 0.5}
    check_schedule(cfg)
    opt = sgd_groups()
    sched = build_scheduler(opt, cfg.optim, cfg.trainer.steps)
    lrs = []
    for _ in range(5):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])


def test_resume_computes_the_built_in_schedule_for_the_new_length():
    cfg = Config()
    cfg.optim = optim(schedule="cosine", lr=0.1)
    cfg.trainer.steps = 10
    opt = sgd_groups()
    sched = build_scheduler(opt, cfg.optim, cfg.trainer.steps)
    for _ in range(4):
        opt.step()
        sched.step()
    state = sched.state_dict()
    cfg.trainer.steps = 20  # extended on resume
    opt2 = sgd_groups()
    sched2 = build_scheduler(opt2, cfg.optim, cfg.trainer.steps)
    restore_scheduler(sched2, opt2, state)
    want = lr_factor(cfg.optim, 20, 4)
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([0.1 * want, 0.05 * want])
    assert want != pytest.approx(lr_factor(cfg.optim, 10, 4))


def test_scheduler_class_state_follows_this_ranks_groups():
    """A pipeline stage may hold other groups than rank 0 saved: the class's per-group lists follow its own."""
    cfg = Config()
    cfg.optim.lr = 0.1
    cfg.optim.scheduler._target_ = "torch.optim.lr_scheduler.StepLR"
    cfg.optim.scheduler.args = {"step_size": 1, "gamma": 0.5}
    saved = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = build_scheduler(saved, cfg.optim, cfg.trainer.steps)
    for _ in range(2):
        saved.step()
        sched.step()
    opt = sgd_groups()
    restore_scheduler(build_scheduler(opt, cfg.optim, cfg.trainer.steps), opt, sched.state_dict())
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.025, 0.0125])


@pytest.mark.parametrize("target,args,key", [
    ("torch.optim.lr_scheduler.ReduceLROnPlateau", {}, "optim.scheduler._target_"),  # needs a metric
    ("torch.optim.SGD", {}, "optim.scheduler._target_"),  # not a scheduler
    ("torch.optim.lr_scheduler.StepLR", {"step_sise": 2}, "optim.scheduler.args"),
    ("torch.optim.lr_scheduler.StepLR", {}, "optim.scheduler.args"),  # step_size is required
])
def test_bad_scheduler_names_the_key(target, args, key):
    cfg = Config()
    cfg.optim.scheduler._target_, cfg.optim.scheduler.args = target, args
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_schedule(cfg)


def test_warmup_with_a_scheduler_class_is_refused():
    o = OptimConfig(warmup_steps=2)
    o.scheduler._target_ = "torch.optim.lr_scheduler.StepLR"
    with pytest.raises(ConfigError, match="optim.warmup_steps"):
        check_optim(o)


def test_a_class_that_cycles_momentum_resumes_it():
    """OneCycleLR changes the groups' betas as it goes: a resume sets those of the saved step, not the first."""
    cfg = Config()
    cfg.optim.scheduler._target_ = "torch.optim.lr_scheduler.OneCycleLR"
    cfg.optim.scheduler.args = {"max_lr": 0.01, "total_steps": 6}

    def make():
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
        return opt, build_scheduler(opt, cfg.optim, cfg.trainer.steps)

    opt, sched = make()
    for _ in range(3):
        opt.step()
        sched.step()
    opt2, sched2 = make()
    restore_scheduler(sched2, opt2, sched.state_dict(), group_settings(opt))
    assert opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"] != (0.95, 0.999)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
