"""``Copies``: N copies of one model held as one module whose every parameter and buffer has a
leading dimension of N, and the function that runs a ``loss_fn`` for all of them at once.

Why one module with stacked tensors (not a list of N modules): the optimizer then updates one
tensor per parameter name instead of N, and the forward pass is one batched call; both are
where a sweep's speed comes from. What a checkpoint saves is that module's ``state_dict``: the
same keys as the model's, each with the leading N.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap

from steplib.errors import ConfigError, describe


class Copies(nn.Module):
    """N copies of one architecture, trained together by a sweep step
    (:func:`~steplib.sweep.sweep_step`). Build it with :meth:`Copies.stack` or :meth:`seeded`.

    Calling it, ``copies(*inputs)``, runs every copy on the same inputs and stacks the outputs
    on a new first dimension of N (for evaluation). ``copies.copy(i)`` is copy ``i`` as a plain
    module of the original class, detached from the sweep (export it, fine-tune it).

    Attributes:
        n: the number of copies.
        stacked: the model's structure with every parameter and buffer stacked to ``[n, ...]``
            (its ``state_dict`` has the model's keys). Do not call it directly: its tensors
            are a sweep's, not one model's.
    """

    # Read by the plain step, which refuses it: trained there, every copy would learn from one
    # loss averaged over the copies. A sweep step runs the loss per copy instead.
    needs_sweep_step = True

    def __init__(self, stacked: nn.Module, n: int) -> None:
        super().__init__()
        self.stacked = stacked
        self.n = n

    @classmethod
    def stack(cls, models: Sequence[nn.Module]) -> Copies:
        """Stack ``models`` (two or more of one architecture) into one ``Copies``; the models
        themselves are left as they were.

        Raises:
            ConfigError: fewer than two models, models of different classes, parameters or
                buffers whose names, shapes or dtypes differ, or parameters frozen
                (``requires_grad``) or modules in a train/eval mode unlike model 0's.

        Example:
            >>> import torch
            >>> copies = Copies.stack([torch.nn.Linear(3, 2) for _ in range(4)])
            >>> copies.n, tuple(copies.stacked.weight.shape)
            (4, (4, 2, 3))
        """
        models = list(models) if isinstance(models, Iterable) else models
        if not isinstance(models, list) or len(models) < 2:
            raise ConfigError(
                f"Copies.stack received {describe(models)}; pass a list of two or more models "
                "of one architecture, e.g. Copies.stack([make_model() for _ in range(8)]), or "
                "Copies.seeded(make_model, seeds=range(8))."
            )
        first = models[0]
        for i, model in enumerate(models):
            _check_same(first, model, i)
        stacked = copy.deepcopy(first)
        persistent = set(first.state_dict())
        # Tied parameters (one object under two names) stay tied: one stacked tensor each.
        done: dict[int, nn.Parameter] = {}
        for module_name, module in list(stacked.named_modules()):
            for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                key = f"{module_name}.{name}" if module_name else name
                if id(param) not in done:
                    values = [m.get_parameter(key).detach() for m in models]
                    done[id(param)] = nn.Parameter(
                        torch.stack(values), requires_grad=param.requires_grad
                    )
                setattr(module, name, done[id(param)])
            for name, buffer in list(module.named_buffers(recurse=False)):
                key = f"{module_name}.{name}" if module_name else name
                if buffer is not None:
                    values = [m.get_buffer(key).detach() for m in models]
                    module.register_buffer(name, torch.stack(values), persistent=key in persistent)
        return cls(stacked, len(models))

    @classmethod
    def seeded(cls, make_model: Callable[[], nn.Module], *, seeds: Iterable[int]) -> Copies:
        """One copy per seed: ``torch.manual_seed(seed); make_model()`` for each, so copy ``i``
        starts where a separate run seeded with ``seeds[i]`` starts. The global RNG is restored
        afterwards.

        Example:
            >>> import torch
            >>> copies = Copies.seeded(lambda: torch.nn.Linear(3, 2), seeds=range(3))
            >>> _ = torch.manual_seed(1)
            >>> torch.equal(copies.copy(1).weight, torch.nn.Linear(3, 2).weight)
            True
        """
        seeds = list(seeds)
        with torch.random.fork_rng(devices=[]):
            models = []
            for seed in seeds:
                torch.manual_seed(seed)
                models.append(make_model())
        return cls.stack(models)

    def copy(self, i: int) -> nn.Module:
        """Copy ``i`` as a plain module of the original class: its own tensors (cloned), in the
        sweep's train/eval mode and with the ``requires_grad`` of the sweep's parameters.

        Raises:
            ConfigError: ``i`` is not an int in ``[0, n)``.
        """
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n:
            raise ConfigError(
                f"Copies.copy received {describe(i)}; pass the index of a copy, an int in "
                f"[0, {self.n}), e.g. copies.copy(int(out.loss.argmin()))."
            )
        model = copy.deepcopy(self.stacked)
        done: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                if id(param) not in done:
                    done[id(param)] = nn.Parameter(
                        param.detach()[i].clone(), requires_grad=param.requires_grad
                    )
                setattr(module, name, done[id(param)])
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer is not None:
                    setattr(module, name, buffer[i].clone())
        return model

    def tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(parameters, buffers)`` by name, each ``[n, ...]``: what :func:`per_copy` maps."""
        return dict(self.stacked.named_parameters()), dict(self.stacked.named_buffers())

    def forward(self, *inputs: Any) -> Any:
        """Every copy on the same ``inputs``; outputs stacked on a new first dimension."""
        return per_copy(lambda model, given: model(*given), self)(inputs)


def per_copy(loss_fn: Callable[[Any, Any], Any], copies: Copies) -> Callable[[Any], Any]:
    """``fn(batch)``: ``loss_fn(model, batch)`` for every copy, on the one shared batch. Inside
    ``loss_fn`` the model is the copy's own (``copies.stacked`` with copy ``i``'s tensors);
    each result is stacked on a new first dimension of ``n``. Random operations (dropout) draw
    different values per copy (``randomness="different"``). A buffer that the model updates
    in place, or sets anew (``self.avg = 0.9 * self.avg + ...``), is each copy's own after
    the call, as it is a plain model's."""
    holder = _LossOf(loss_fn, copies.stacked)

    def run(batch: Any) -> Any:
        # Every slot of every tensor, a tied one under each of its names: functional_call
        # then has no ties to find (tie_weights=False), and vmap maps a flat tuple. The batch
        # is closed over, not mapped: vmap leaves it whole without flattening it each call.
        named = slots(copies.stacked)
        names = [f"model.{name}" for name, _ in named]

        def one(*tensors: torch.Tensor) -> Any:
            swapped = dict(zip(names, tensors, strict=True))
            return functional_call(holder, swapped, (batch,), tie_weights=False)

        result, replaced = vmap(one, randomness="different")(*(tensor for _, tensor in named))
        with torch.no_grad():  # what functional_call put back would lose: copied in, per copy
            for name, value in replaced.items():
                copies.stacked.get_buffer(name).copy_(value)
        return result

    return run


def slots(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every attribute that holds a parameter or buffer: a tensor tied
    under two attributes (an encoder's and a decoder's weight) under each, a module used under
    two names (``self.b = self.a``) once, its attributes being one place. ``functional_call``
    swaps a place given twice twice, and puts back the first swap's tensor: one copy's slice
    of the weight was left in the model (it failed at the next call, the model spoilt)."""
    named: list[tuple[str, torch.Tensor]] = []
    for prefix, module in model.named_modules():
        named += module.named_parameters(prefix, recurse=False, remove_duplicate=False)
        named += module.named_buffers(prefix, recurse=False, remove_duplicate=False)
    return named


class _LossOf(nn.Module):
    """``loss_fn(model, batch)`` as a module whose ``model`` ``functional_call`` can swap; it
    returns ``(result, buffers set anew)``: a buffer the model assigned during the call
    (``self.n = self.n + 1``) would be lost when ``functional_call`` puts its tensor back."""

    def __init__(self, loss_fn: Callable[[Any, Any], Any], model: nn.Module) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.model = model

    def forward(self, batch: Any) -> Any:
        before = dict(self.model.named_buffers(remove_duplicate=False))
        result = self.loss_fn(self.model, batch)
        after = self.model.named_buffers(remove_duplicate=False)
        return result, {k: v for k, v in after if k in before and v is not before[k]}


def _check_same(first: nn.Module, model: nn.Module, i: int) -> None:
    if not isinstance(model, nn.Module) or type(model) is not type(first):
        raise ConfigError(
            f"Copies.stack received {describe(model)} at index {i} and a "
            f"{type(first).__name__} at index 0; every copy must be the same architecture. "
            "Build each with the same function: [make_model() for _ in range(n)]."
        )
    for kind in ("state_dict",):
        mine = {k: (tuple(v.shape), v.dtype) for k, v in getattr(first, kind)().items()}
        theirs = {k: (tuple(v.shape), v.dtype) for k, v in getattr(model, kind)().items()}
        if mine != theirs:
            differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            raise ConfigError(
                f"Copies.stack: model {i} differs from model 0 in {differ[:3]} (names, shapes "
                "or dtypes); every copy must be the same architecture. A search over "
                "architectures is not a vectorised sweep: run those separately."
            )
    # One stacked tensor has one requires_grad, one module one mode: copy 0's would be taken for
    # all, training a parameter frozen in some copy (or freezing one it trains) in silence.
    for what, of in (
        ("requires_grad", lambda m: {k: p.requires_grad for k, p in m.named_parameters()}),
        ("train/eval mode", lambda m: {k: sub.training for k, sub in m.named_modules()}),
    ):
        mine, theirs = of(first), of(model)
        if mine != theirs:
            differ = sorted(k or "(the model)" for k in mine if mine[k] != theirs.get(k))
            raise ConfigError(
                f"Copies.stack: model {i} differs from model 0 in the {what} of "
                f"{differ[:3]}; a sweep trains every copy alike. Freeze "
                "the same parameters and set the same mode in every copy (model.train() or "
                "model.eval() on each) before stacking them."
            )
