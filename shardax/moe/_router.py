"""Routing tokens to experts: top-k over softmax or sigmoid scores, and
the auxiliary terms that balance the load.

Everything here is a pure function of tensors: the router's logits in,
a :class:`Routing` out; the losses and the bias update read a Routing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import ShardingError

__all__ = ["Routing", "load_balancing_loss", "route", "update_bias", "z_loss"]

SCORES = ("softmax", "sigmoid")


class Routing(NamedTuple):
    """Where each token goes: ``experts[t, i]`` is token ``t``'s ``i``-th
    expert (best first) and ``weights[t, i]`` the weight of its output;
    ``probs`` (``[tokens, experts]``) the router's scores, for the
    load-balancing loss."""

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]

    def counts(self) -> torch.Tensor:
        """Tokens sent to each expert (``[experts]``, int64)."""
        return torch.bincount(self.experts.reshape(-1), minlength=self.num_experts)


def route(
    logits: torch.Tensor,
    k: int,
    *,
    score: str = "softmax",
    norm_topk: bool = True,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
) -> Routing:
    """Each token's ``k`` experts and their weights, from the router's
    ``logits`` (``[tokens, experts]``).

    ``score="softmax"`` (Mixtral, Qwen2-MoE, Switch, GShard): probabilities
    over all experts, in fp32; ``"sigmoid"`` (DeepSeek-V3): each expert's
    affinity on its own. ``norm_topk``: the k weights divided by their sum
    (Mixtral: True; Qwen2-MoE: its ``norm_topk_prob``). ``bias``
    (``[experts]``, auxiliary-loss-free balancing, DeepSeek-V3): added to the
    scores to *choose* the experts only — the weights come from the scores
    without it. ``scale``: the weights' factor (DeepSeek-V3's
    ``routed_scaling_factor``). Ties go to the lower expert index, so the
    same token goes to the same experts on any mesh.

    >>> import torch
    >>> r = route(torch.tensor([[2.0, 1.0, 0.0]]), 2)
    >>> r.experts.tolist(), [round(w, 4) for w in r.weights[0].tolist()]
    ([[0, 1]], [0.7311, 0.2689])
    """
    if logits.dim() != 2:
        raise ShardingError(
            f"route takes the router's logits as [tokens, experts]; got shape {tuple(logits.shape)}"
        )
    n = logits.shape[-1]
    if not 1 <= k <= n:
        raise ShardingError(f"route: k={k} experts per token out of {n}; k is 1..{n}")
    if score not in SCORES:
        raise ShardingError(f"route: score is one of {SCORES}; got {score!r}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ShardingError(
            f"route: bias has shape {tuple(bias.shape)}; it is one value per expert ({n},)"
        )
    x = logits.float()
    probs = torch.softmax(x, dim=-1) if score == "softmax" else torch.sigmoid(x)
    choose = probs if bias is None else probs + bias.float()
    _, experts = torch.topk(choose, k, dim=-1, sorted=True)
    weights = probs.gather(-1, experts)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights * scale, probs)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """The Switch/GShard auxiliary loss, as Hugging Face computes it:
    ``E · Σ_e f_e · P_e`` summed over the k choices, where ``f_e`` is the
    fraction of tokens whose choice goes to expert ``e`` and ``P_e`` the
    mean router probability of ``e``. 1 × k when the load is uniform.

    >>> import torch
    >>> r = route(torch.zeros(4, 2), 1)  # uniform probabilities, all on expert 0
    >>> float(load_balancing_loss(r))
    1.0
    """
    n = routing.num_experts
    chosen = torch.nn.functional.one_hot(routing.experts, n).float()  # [tokens, k, experts]
    fraction = chosen.mean(dim=0)  # [k, experts]
    mean_prob = routing.probs.float().mean(dim=0)  # [experts]
    return (fraction * mean_prob[None]).sum() * n


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """The router z-loss (ST-MoE): the mean squared log-sum-exp of the
    logits, which keeps them small.

    >>> import torch
    >>> float(z_loss(torch.zeros(3, 4))) == float(torch.log(torch.tensor(4.0)) ** 2)
    True
    """
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def update_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """Auxiliary-loss-free balancing (DeepSeek-V3): each expert's routing
    bias moved by ``rate`` toward the mean load — up where the expert got
    fewer tokens than the mean, down where more. A new tensor; pass the
    step's (global) ``counts``, e.g. ``psum`` of :meth:`Routing.counts`.

    >>> import torch
    >>> update_bias(torch.zeros(3), torch.tensor([5, 1, 3]), 0.1).tolist()
    [-0.10000000149011612, 0.10000000149011612, 0.0]
    """
    load = counts.float()
    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)
