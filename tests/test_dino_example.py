"""facebookresearch/dino's ``main_dino.py`` (a student trained by AdamW on the cross-entropy
between its multi-crop outputs and a centred, sharpened teacher's; the teacher an average of the
student taken after each update on a cosine momentum schedule) written as its plain loop and with
steplib gives the same student, teacher, centre and optimizer state and the same losses, bit for
bit, also killed and resumed in new objects inside the first epoch (while the last layer's
gradients are cancelled), at an epoch's end and inside the last epoch, and on 2 gloo ranks (the
student in DDP, the centre all-reduced) killed and resumed in new processes.

What the port keeps of ``train_one_epoch`` and ``utils.py`` (written here, not copied): the rate
and weight decay set by hand into the parameter groups at every iteration from precomputed
``cosine_scheduler`` arrays (the decay into the first group only), ``clip_gradients`` (each
parameter's gradient clipped by its own norm), ``cancel_gradients_last_layer`` (the last layer's
gradients dropped, ``p.grad = None``, during the first ``freeze_last_layer`` epochs: AdamW then
skips it, its moments and weight decay included), the teacher's average after the optimizer
step, ``DINOLoss`` with its teacher temperature warm-up and its centre, a buffer updated from the
teacher's outputs in the loss's forward; ``MultiCropWrapper`` over 2 global and 2 local crops
(shorter "images") and a ``DINOHead`` whose last layer is weight-normalised with its norm frozen.

With steplib the student, the teacher and the loss are one ``ModuleDict`` (the centre is the
loss's buffer, the teacher frozen parameters), so a checkpoint holds them without their being
named; the rate, decay and cancelled gradients are one ``tap(before_update=...)`` (where
``state.step`` is DINO's ``it`` and ``state.epoch`` its ``epoch``), the per-parameter clipping
is a part at ``CLIP``, the teacher's average a ``step_end`` handler, and ``--use_fp16``
``amp_wrap(step, dtype=torch.float16)`` with the state's ``GradScaler`` (the default scale
overflows at 4 of the 24 updates: skipped in both, the teacher averaged all the same).
The recipe: docs/migration/README.md, "A teacher averaged from its student (DINO)".
"""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from steplib import (
    EMA,
    ConfigError,
    Events,
    TrainState,
    amp_wrap,
    make_train_step,
    run,
    seed_everything,
    tap,
)
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.distributed import apply_ddp
from steplib.events import Event
from steplib.step import CLIP, Gradients, Part, Step, add_part, ddp_wrap
from steplib.testing import run_ranks
from tests.checkpoint_helpers import (
    KilledError,
    assert_same_on_ranks,
    assert_same_run,
    record_and_kill,
)

CHANNELS, GLOBAL, LOCAL = 3, 6, 3  # an "image": CHANNELS x length; local crops are shorter
EMBED, HIDDEN, BOTTLENECK, OUT_DIM = 8, 16, 8, 12  # DINOHead(in_dim, out_dim, hidden, bottleneck)
LOCAL_CROPS = 2  # --local_crops_number
LR, MIN_LR, WARMUP_EPOCHS = 0.01, 1e-4, 1  # --lr (scaled), --min_lr, --warmup_epochs
WD, WD_END = 0.04, 0.4  # --weight_decay, --weight_decay_end
MOMENTUM_TEACHER = 0.9  # --momentum_teacher (0.996; lower so the teacher moves in 24 updates)
WARMUP_TEACHER_TEMP, TEACHER_TEMP, WARMUP_TEACHER_TEMP_EPOCHS = 0.04, 0.07, 2
CLIP_GRAD, FREEZE_LAST_LAYER = 0.3, 1  # --clip_grad, --freeze_last_layer
BATCH, SAMPLES, EPOCHS = 8, 50, 4  # 6 iterations an epoch (drop_last), 24 in all
UPDATES = SAMPLES // BATCH
EVERY = 4  # a save every 4 updates: inside the first epoch, at the second's end, in the last


class Backbone(nn.Module):
    """A tiny stand-in for the ViT: a 2-layer MLP over each position, averaged over the length
    (so crops of any length pass, as a ViT takes any resolution)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(CHANNELS, EMBED), nn.GELU(), nn.Linear(EMBED, EMBED))
        self.fc: nn.Module = nn.Linear(EMBED, 10)  # the classifier MultiCropWrapper removes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.mlp(x.transpose(1, 2)).mean(1))


class DINOHead(nn.Module):
    """vision_transformer.py's ``DINOHead`` (nlayers=3, no batch norm); its last layer through
    ``parametrizations.weight_norm`` (torch's deprecated ``weight_norm`` warns: the same g and v,
    named ``original0``/``original1`` instead of ``weight_g``/``weight_v``)."""

    def __init__(self, norm_last_layer: bool = True) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(EMBED, HIDDEN),
            nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.GELU(),
            nn.Linear(HIDDEN, BOTTLENECK),
        )
        self.apply(self._init_weights)
        last = nn.Linear(BOTTLENECK, OUT_DIM, bias=False)
        self.last_layer = nn.utils.parametrizations.weight_norm(last)
        weight_g = self.last_layer.parametrizations.weight.original0
        weight_g.data.fill_(1)
        if norm_last_layer:
            weight_g.requires_grad = False

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.3)  # DINO: 0.02, for widths of 2048
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    """utils.py's: the backbone once per run of crops of one resolution, the head once."""

    def __init__(self, backbone: Backbone, head: nn.Module) -> None:
        super().__init__()
        backbone.fc = nn.Identity()
        self.backbone, self.head = backbone, head

    def forward(self, x: Any) -> torch.Tensor:
        if not isinstance(x, list):
            x = [x]
        idx_crops = torch.cumsum(
            torch.unique_consecutive(
                torch.tensor([inp.shape[-1] for inp in x]), return_counts=True
            )[1],
            0,
        )
        start_idx, output = 0, torch.empty(0).to(x[0].device)
        for end_idx in idx_crops:
            out = self.backbone(torch.cat(x[start_idx:end_idx]))
            output = torch.cat((output, out))
            start_idx = end_idx
        return self.head(output)


class DINOLoss(nn.Module):
    """main_dino.py's, as written there (the centre a buffer, replaced in ``update_center``)."""

    center: torch.Tensor

    def __init__(self, student_temp: float = 0.1, center_momentum: float = 0.9) -> None:
        super().__init__()
        self.student_temp, self.center_momentum = student_temp, center_momentum
        self.ncrops = 2 + LOCAL_CROPS
        self.register_buffer("center", torch.zeros(1, OUT_DIM))
        self.teacher_temp_schedule: Any = np.concatenate(
            (
                np.linspace(WARMUP_TEACHER_TEMP, TEACHER_TEMP, WARMUP_TEACHER_TEMP_EPOCHS),
                np.ones(EPOCHS - WARMUP_TEACHER_TEMP_EPOCHS) * TEACHER_TEMP,
            )
        )

    def forward(
        self, student_output: torch.Tensor, teacher_output: torch.Tensor, epoch: Any
    ) -> Any:
        student_out = (student_output / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_soft = F.softmax((teacher_output - self.center) / temp, dim=-1)
        teacher_out = teacher_soft.detach().chunk(2)
        total_loss: Any = 0
        n_loss_terms = 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue  # the student and the teacher on the same view
                loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
                total_loss += loss.mean()
                n_loss_terms += 1
        total_loss /= n_loss_terms
        self.update_center(teacher_output)
        return total_loss

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True)
        world = 1
        if dist.is_initialized():
            dist.all_reduce(batch_center)
            world = dist.get_world_size()
        batch_center = batch_center / (len(teacher_output) * world)
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


class DeviceTempDINOLoss(DINOLoss):
    """The teacher temperatures as a float64 tensor (a buffer would follow the model to the
    GPU; a plain attribute here: the schedule is no state): indexed by the step's epoch tensor,
    no host read, and a division by a 0-dim float64 tensor rounds as the one by the numpy
    scalar does."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher_temp_schedule = torch.from_numpy(self.teacher_temp_schedule)


class MultiCrops(Dataset[tuple[list[torch.Tensor], int]]):
    """``ImageFolder`` with ``DataAugmentationDINO``: 2 global views and ``LOCAL_CROPS`` local
    ones (a random window of the sample), drawn from the global generator when it is loaded."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.data = torch.randn(SAMPLES, CHANNELS, GLOBAL, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[list[torch.Tensor], int]:
        x = self.data[i]
        crops = [x * (1 + 0.2 * torch.randn(x.shape)) + 0.1 * torch.randn(x.shape) for _ in "gg"]
        for _ in range(LOCAL_CROPS):
            start = int(torch.randint(0, GLOBAL - LOCAL + 1, ()))
            crops.append(x[:, start : start + LOCAL] + 0.1 * torch.randn(CHANNELS, LOCAL))
        return crops, 0


def cosine_scheduler(
    base_value: float,
    final_value: float,
    epochs: int,
    niter_per_ep: int,
    warmup_epochs: int = 0,
    start_warmup_value: float = 0,
) -> np.ndarray:
    """utils.py's, as written there."""
    warmup_schedule = np.array([])
    warmup_iters = warmup_epochs * niter_per_ep
    if warmup_epochs > 0:
        warmup_schedule = np.linspace(start_warmup_value, base_value, warmup_iters)
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final_value + 0.5 * (base_value - final_value) * (
        1 + np.cos(np.pi * iters / len(iters))
    )
    schedule = np.concatenate((warmup_schedule, schedule))
    assert len(schedule) == epochs * niter_per_ep
    return schedule


LR_SCHEDULE = cosine_scheduler(LR, MIN_LR, EPOCHS, UPDATES, warmup_epochs=WARMUP_EPOCHS)
WD_SCHEDULE = cosine_scheduler(WD, WD_END, EPOCHS, UPDATES)
MOMENTUM_SCHEDULE = cosine_scheduler(MOMENTUM_TEACHER, 1, EPOCHS, UPDATES)


def get_params_groups(model: nn.Module) -> list[dict[str, Any]]:
    """utils.py's: no weight decay on biases and norms."""
    regularized, not_regularized = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith(".bias") or len(param.shape) == 1:
            not_regularized.append(param)
        else:
            regularized.append(param)
    return [{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}]


def clip_gradients(model: nn.Module, clip: float) -> list[float]:
    """utils.py's, as written there (two host reads per parameter)."""
    norms = []
    for _, p in model.named_parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)
            norms.append(param_norm.item())
            clip_coef = clip / (param_norm + 1e-6)
            if clip_coef < 1:
                p.grad.data.mul_(clip_coef)
    return norms


def cancel_gradients_last_layer(epoch: int, model: nn.Module, freeze_last_layer: int) -> None:
    """utils.py's, as written there."""
    if epoch >= freeze_last_layer:
        return
    for n, p in model.named_parameters():
        if "last_layer" in n:
            p.grad = None


def set_lr_and_wd(optimizer: torch.optim.Optimizer, it: int, number: Any = float) -> None:
    """train_one_epoch's first lines; ``number=np.float64`` sets them as written there (the
    arrays' own scalars), ``float`` as Python floats: the same doubles, the same updates bit
    for bit, and a checkpoint ``torch.load(weights_only=True)`` can read (it refuses a
    ``numpy.float64``: steplib's save refuses it too, with the fix)."""
    for i, param_group in enumerate(optimizer.param_groups):
        param_group["lr"] = number(LR_SCHEDULE[it])
        if i == 0:  # only the first group is regularized
            param_group["weight_decay"] = number(WD_SCHEDULE[it])


@torch.no_grad()
def update_teacher(student: nn.Module, teacher: nn.Module, it: int) -> None:
    """train_one_epoch's EMA update for the teacher, as written there."""
    m = MOMENTUM_SCHEDULE[it]
    for param_q, param_k in zip(student.parameters(), teacher.parameters(), strict=True):
        param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)


def _setup(
    loss: type[DINOLoss] = DINOLoss, world: int = 1, ddp: Any = DistributedDataParallel
) -> tuple[nn.ModuleDict, torch.optim.Optimizer, Any]:
    """main_dino.py's networks, loss and optimizer; the loader: steplib's shuffled one, on
    ``world`` ranks each its share (DistributedSampler's) and the student in ``ddp(...)``."""
    seed_everything(0)
    student: nn.Module = MultiCropWrapper(Backbone(), DINOHead())
    teacher = MultiCropWrapper(Backbone(), DINOHead())
    if world > 1:
        student = ddp(student)
    teacher.load_state_dict(inner(student).state_dict())
    for p in teacher.parameters():
        p.requires_grad = False
    model = nn.ModuleDict({"student": student, "teacher": teacher, "loss": loss()})
    optimizer = torch.optim.AdamW(get_params_groups(student))
    loader = resumable_loader(
        MultiCrops(), batch_size=BATCH // world, seed=3, drop_last=True, shard=world > 1
    )
    return model, optimizer, loader


def inner(module: nn.Module) -> nn.Module:
    """main_dino.py's ``student.module`` under DDP."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def _result(model: nn.Module, optimizer: Any, losses: list[Any]) -> dict[str, Any]:
    """Copies; the rates and decays as floats (``run_ranks`` sends results back with
    ``torch.save``, read with ``weights_only=True``: no numpy; compared by ``==`` anyway)."""
    saved = optimizer.state_dict()
    groups = [
        {k: float(v) if isinstance(v, np.floating) else v for k, v in g.items()}
        for g in saved["param_groups"]
    ]
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        # the moments, and each group's last rate and decay
        "optimizer": {**saved, "param_groups": groups},
        "losses": [loss.detach().clone() for loss in losses],
    }


@functools.cache  # the tests compare with it, never change it
def _plain(fp16: bool = False, world: int = 1) -> dict[str, Any]:
    """main_dino.py's ``train_one_epoch`` over the epochs, with ``--use_fp16`` or without, in
    one process or on ``world`` ranks (the student in ``DistributedDataParallel``)."""
    model, optimizer, loader = _setup(world=world)
    student, teacher, dino_loss = model["student"], model["teacher"], model["loss"]
    fp16_scaler = torch.amp.GradScaler("cpu") if fp16 else None
    losses, scales, lrs = [], [], []
    for epoch in range(EPOCHS):
        for it, (images, _) in enumerate(loader):
            it = len(loader) * epoch + it  # global training iteration
            set_lr_and_wd(optimizer, it, number=np.float64)
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16_scaler is not None):
                teacher_output = teacher(images[:2])  # only the 2 global views
                student_output = student(images)
                loss = dino_loss(student_output, teacher_output, epoch)
            assert math.isfinite(loss.item())
            optimizer.zero_grad()
            if fp16_scaler is None:
                loss.backward()
                clip_gradients(student, CLIP_GRAD)
                cancel_gradients_last_layer(epoch, student, FREEZE_LAST_LAYER)
                optimizer.step()
            else:
                scales.append(fp16_scaler.get_scale())
                fp16_scaler.scale(loss).backward()
                fp16_scaler.unscale_(optimizer)
                clip_gradients(student, CLIP_GRAD)
                cancel_gradients_last_layer(epoch, student, FREEZE_LAST_LAYER)
                fp16_scaler.step(optimizer)
                fp16_scaler.update()
            update_teacher(inner(student), teacher, it)
            losses.append(loss)
            lrs.append(float(optimizer.param_groups[0]["lr"]))
    return {**_result(model, optimizer, losses), "scales": scales, "lrs": lrs}


def loss_fn(model: Any, batch: Any, step: torch.Tensor) -> torch.Tensor:
    """The forward of ``train_one_epoch``; the epoch from the step number (``it``)."""
    images, _ = batch
    teacher_output = model["teacher"](images[:2])
    student_output = model["student"](images)
    return model["loss"](student_output, teacher_output, step // UPDATES)


def clip_per_parameter(step: Step, clip: float) -> Step:
    """``utils.clip_gradients`` as a part: each gradient times ``min(1, clip / (norm +
    1e-6))``, with no host read (a factor of 1 leaves the bits as they are)."""

    def clip_grads(grads: Gradients) -> None:
        for g in grads.grads:
            clip_coef = clip / (g.norm(2) + 1e-6)
            g.mul_(clip_coef.clamp(max=1.0))

    return add_part(step, Part(name="clip_per_parameter", grad_transform=clip_grads, order=CLIP))


def before_update(state: TrainState, number: Any = float) -> None:
    """Before each optimizer step: this iteration's rate and decay, and the first epochs'
    cancelled last layer (after clipping, as in train_one_epoch)."""
    set_lr_and_wd(state.optimizer, state.step, number=number)
    model: Any = state.model  # the ModuleDict
    cancel_gradients_last_layer(state.epoch, model["student"], FREEZE_LAST_LAYER)


def dino_step(number: Any = float, fp16: bool = False) -> Step:
    hook = functools.partial(before_update, number=number)
    step = tap(clip_per_parameter(make_train_step(loss_fn), CLIP_GRAD), before_update=hook)
    return amp_wrap(step, dtype=torch.float16) if fp16 else step


def teacher_average(event: Event) -> None:
    """After each update (``event.step`` updates so far, so DINO's ``it`` is one less)."""
    model = event.state.model
    update_teacher(inner(model["student"]), model["teacher"], event.step - 1)


def _steplib(
    url: str | None = None,
    kill_at: int | None = None,
    save_first: bool = False,
    number: Any = float,
    fp16: bool = False,
    loss: type[DINOLoss] = DINOLoss,
    world: int = 1,
) -> dict[str, Any]:
    model, optimizer, loader = _setup(loss, world, ddp=apply_ddp)
    events = Events()
    ckpt = checkpoint_every(url, every=EVERY) if url is not None else None
    if ckpt is not None:
        events.add(resume_from(ckpt))
        if save_first:  # registered before the teacher's average: it saves after it anyway
            events.add(ckpt)
    events.on("step_end", teacher_average)
    if ckpt is not None and not save_first:
        events.add(ckpt)
    resumed, losses, lrs = record_and_kill(events, kill_at)  # lrs: the rates the step used
    scaler = torch.amp.GradScaler("cpu") if fp16 else None
    state = TrainState.create(model=model, optimizer=optimizer, scaler=scaler)
    with contextlib.suppress(KilledError):
        step = dino_step(number, fp16)
        run(ddp_wrap(step) if world > 1 else step, state, loader, events=events, max_epochs=EPOCHS)
    return {**_result(model, optimizer, losses), "resumed": resumed[0], "lrs": lrs}


@pytest.mark.parametrize("fp16", [False, True])
def test_dino_loop_with_steplib_equals_it_bit_for_bit(fp16: bool) -> None:
    want = _plain(fp16)
    model = want["model"]
    # the run is not trivial: the teacher moved away from the student, the centre from 0, and
    # the last layer's v moved (after the first epoch) while its g stayed frozen at 1
    assert not torch.equal(model["teacher.head.mlp.0.weight"], model["student.head.mlp.0.weight"])
    assert model["loss.center"].abs().min() > 0
    assert torch.equal(
        model["student.head.last_layer.parametrizations.weight.original0"], torch.ones(OUT_DIM, 1)
    )
    if fp16:  # float16 overflowed at updates 1, 2, 6 and 8: skipped, the scale backed off
        assert want["scales"][:10] == [
            2.0**16,
            2.0**15,
            *[2.0**14] * 4,
            *[2.0**13] * 2,
            2.0**12,
            2.0**12,
        ]
    assert_same_run(_steplib(fp16=fp16), want)


@pytest.mark.parametrize(
    ("kill_at", "save_first", "fp16"),
    [
        (3, False, False),
        (6, False, False),
        (14, True, False),
        (22, False, False),
        (22, True, False),
        (10, False, True),
    ],
)
# before any save (a fresh start); after the save at update 4, inside the first epoch (the last
# layer's gradients cancelled, its AdamW moments not yet made); after the save at the second
# epoch's end (12); after the save at 20, inside the last epoch; with the checkpoint handler
# registered before or after the teacher's average; under float16 after the save at 8 (an
# overflowed update, the scale backed off)
def test_dino_loop_killed_and_resumed_equals_it_uninterrupted(
    tmp_path: Path, kill_at: int, save_first: bool, fp16: bool
) -> None:
    url = str(tmp_path / "ckpt")
    _steplib(url, kill_at=kill_at, save_first=save_first, fp16=fp16)
    resumed = _steplib(url, save_first=save_first, fp16=fp16)
    assert resumed["resumed"] == kill_at // EVERY * EVERY
    assert_same_run(resumed, _plain(fp16))


def test_the_teacher_temperatures_as_a_tensor_train_the_same_bits() -> None:
    """``self.teacher_temp_schedule[epoch]`` indexes a numpy array with the step's epoch
    tensor: a host read (``__index__``), on a GPU a wait each step. The same temperatures in a
    tensor are indexed on the device and train the same bits."""
    assert_same_run(_steplib(loss=DeviceTempDINOLoss), _plain())


@pytest.mark.parametrize("fp16", [False, True])
def test_steplibs_ema_as_the_teacher_is_not_dinos(fp16: bool) -> None:
    """What the recipe's page says: ``EMA(student, decay=lambda n: momentum_schedule[n - 1])``
    averages with ``lerp`` (rounded once; DINO's ``mul_(m).add_((1 - m) * q)`` twice) and only
    after an applied update; DINO averages after every iteration, one whose float16 gradients
    overflowed too."""
    want = _plain(fp16)
    model, optimizer, loader = _setup()
    ema = EMA(model["student"], decay=lambda n: float(MOMENTUM_SCHEDULE[n - 1]))
    model["teacher"] = ema.module
    events = Events(ema)
    losses: list[torch.Tensor] = []
    events.on("step_end", lambda e: losses.append(e.output.loss))
    scaler = torch.amp.GradScaler("cpu") if fp16 else None
    state = TrainState.create(model=model, optimizer=optimizer, scaler=scaler)
    run(dino_step(fp16=fp16), state, loader, events=events, max_epochs=EPOCHS)
    got = model.state_dict()

    def apart(prefix: str) -> float:
        return max(float((got[k] - v).abs().max()) for k, v in want["model"].items() if prefix in k)

    loss_apart = max(float((a - b).abs()) for a, b in zip(losses, want["losses"], strict=True))
    if not fp16:  # the rounding alone: 2e-6 in the losses, 1e-6 in the student
        assert 0 < loss_apart < 1e-5 and 0 < apart("student") < 1e-5
    else:  # 4 overflowed updates not averaged: 0.19 in the losses, 0.02 in the student
        assert loss_apart > 0.1 and apart("student") > 0.01 and apart("teacher") > 0.001


def _plain_on_ranks(rank: int, world: int) -> dict[str, Any]:
    return _plain(world=world)


def _steplib_on_ranks(rank: int, world: int, **kwargs: Any) -> dict[str, Any]:
    return _steplib(world=world, **kwargs)


def test_dino_under_ddp_killed_and_resumed_equals_its_ddp_loop(tmp_path: Path) -> None:
    """2 gloo ranks: the student in DDP (``apply_ddp`` + ``ddp_wrap``), the centre from the
    teacher's outputs of both (``DINOLoss``'s all-reduce); killed at update 14 and resumed from
    the save at 12 in new processes, and run through uninterrupted."""
    url = str(tmp_path / "ckpt")
    want = run_ranks(_plain_on_ranks, world=2)
    assert not torch.equal(want[0]["losses"][0], want[1]["losses"][0])  # each rank its own
    assert_same_on_ranks(run_ranks(_steplib_on_ranks, world=2), want)
    run_ranks(functools.partial(_steplib_on_ranks, url=url, kill_at=14), world=2)
    got = run_ranks(functools.partial(_steplib_on_ranks, url=url), world=2)
    assert [rank["resumed"] for rank in got] == [12, 12]
    assert_same_on_ranks(got, want)


def test_a_numpy_rate_set_by_hand_is_refused_at_the_save_not_found_corrupt_at_the_resume(
    tmp_path: Path,
) -> None:
    """train_one_epoch sets ``param_group["lr"] = lr_schedule[it]``, a ``numpy.float64``,
    which ``torch.load(weights_only=True)`` refuses. It subclasses ``float``, so the save's
    check let it through: the run wrote 5 checkpoints (20 updates), none could be read, and the
    resume called each one corrupt ("written by another program or torch version") and gave
    up. Refused at the first save instead, with the fix."""
    url = str(tmp_path / "ckpt")
    message = r"\['lr'\] is np.float64\(0.006\) \(type float64\).*float\(x\)"
    with pytest.raises(ConfigError, match=message):
        _steplib(url, number=np.float64)
