"""The classic fine-tune: a pretrained body frozen under a new head, the body unfrozen after a
few updates (with its own, lower learning rate), checkpoints and an exact resume. Run by
tests/test_fine_tune_example.py, which kills it past the unfreeze and resumes it."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import steplib as sl

UNFREEZE_AT = 4  # updates with the head alone


def pretrained_body(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # stands in for weights loaded from a hub or load_weights(...)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())


def main(root: str = "runs/fine_tune", max_steps: int = 12) -> sl.TrainState:
    sl.seed_everything(0)
    body, head = pretrained_body(), nn.Linear(16, 3)  # a new head for 3 classes
    model = nn.Sequential(body, head)
    body.requires_grad_(False)
    opt = torch.optim.AdamW(
        [{"params": body.parameters(), "lr": 1e-4}, {"params": head.parameters(), "lr": 1e-2}]
    )
    state = sl.TrainState.create(model=model, optimizer=opt)
    step = sl.make_train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    loader = sl.resumable_loader(data, batch_size=8, seed=0)

    def unfreeze(event: sl.Event) -> None:
        body.requires_grad_(True)  # saved with each checkpoint: a resume past it keeps it

    ckpt = sl.checkpoint_every(root, every=3)
    events = sl.Events(sl.resume_from(ckpt), ckpt).on("step_end", unfreeze, once=UNFREEZE_AT)
    return sl.run(step, state, loader, events=events, max_steps=max_steps)


if __name__ == "__main__":
    final = main()
    trainable = all(p.requires_grad for p in final.model.parameters())
    print(f"{final.step} updates; everything trainable after the unfreeze: {trainable}")
