"""Names for a training state that do not depend on how the model is split over ranks.

A sharded checkpoint (:mod:`ptxtrain.train.checkpoint`) stores one flat dict of tensors under
these names, each rank writing the entries it owns and reading the entries it holds, so a
checkpoint written by one layout (one process, ``--ep``, ``--pp``, both) loads into any other::

    model.<fqn>              a model.state_dict() entry (parameter or buffer) of the full model
    model.<fqn>.<e>          routed expert e (global index in [0, E)) of a stacked expert
                             weight [E_local, ...] (Experts.w1 / w3 / w2): one tensor [...]
    optim.<fqn>.<key>        optimizer state ``key`` of parameter <fqn>: AdamW's ``step`` (0-d
                             FP32), ``master`` (FP32), ``exp_avg`` / ``exp_avg_sq`` (BF16 or
                             FP32), with the dtype the optimizer keeps
    optim.<fqn>.<e>.<key>    the same for expert e, for state tensors shaped like the stacked
                             parameter (the moments, the master); ``step`` stays per parameter

``<fqn>`` is the parameter's name in the full model (``layers.3.ffn.experts.w1``), whatever
pipeline stage holds it. Expert ``e`` lives on the rank whose :class:`~ptxtrain.moe.Experts`
has ``expert_offset <= e < expert_offset + num_local_experts`` (any module with those two
attributes and ``num_experts`` counts as stacked experts). The optimizer's parameter groups are
stored beside the tensors, as each parameter name's group hyper-parameters
(:meth:`StateLayout.param_groups`). Source: torchtitan's and Megatron's distributed checkpoints
key the full model's names the same way, so that any parallel layout can read them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["MODEL_PREFIX", "OPTIM_PREFIX", "LayoutError", "StateLayout"]

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
# optim.<fqn>.<e>.<key> (an expert's entry) or optim.<fqn>.<key>; <key> has no dot.
_EXPERT_KEY = re.compile(r"^(.+)\.(\d+)\.([^.]+)$")
_PLAIN_KEY = re.compile(r"^(.+)\.([^.]+)$")


class LayoutError(ValueError):
    """Stored entries that do not fit this model and optimizer (missing, unexpected, reshaped)."""


class StateLayout:
    """Which entries of a model's and its optimizer's state this rank writes and reads, under
    the layout-independent names of the module docstring.

    Args:
        model: the full model. Every rank holds its whole module tree; a pipeline rank's stages
            share their submodules with it, and an expert-parallel rank's
            :class:`~ptxtrain.moe.Experts` hold ``num_local_experts`` of ``num_experts``.
        optimizer: this rank's optimizer (``state_dict()`` / ``load_state_dict()`` in torch's
            format, e.g. :class:`~ptxtrain.optim.AdamW`), over parameters of ``model``.
        save_modules: the modules whose state this rank writes (a pipeline rank: the stages it
            owns, so that a DualPipe mirror copy is written once); None = the whole model.
        load_modules: the modules whose state this rank reads (a pipeline rank: every stage it
            holds); None = the whole model.

    Raises:
        ValueError: an optimizer parameter that is not a parameter of ``model``, or a module of
            ``save_modules`` / ``load_modules`` whose state is not part of ``model``'s.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        save_modules: Iterable[nn.Module] | None = None,
        load_modules: Iterable[nn.Module] | None = None,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.save_modules = None if save_modules is None else list(save_modules)
        self.load_modules = None if load_modules is None else list(load_modules)
        self.refresh()

    def refresh(self) -> None:
        """Look the live tensors up again (a module may have replaced a parameter or buffer
        since, e.g. when experts are split); :meth:`save_state` and :meth:`model_targets` do.

        Raises:
            ValueError: see the class docstring.
        """
        model = self.model
        self.state = dict(model.state_dict(keep_vars=True))  # name -> live tensor
        name_of = {id(t): n for n, t in self.state.items()}
        pname = {id(p): n for n, p in model.named_parameters()}
        # id(stacked expert weight) -> (first global expert held here, global expert count)
        self.experts: dict[int, tuple[int, int]] = {}
        for m in model.modules():
            if hasattr(m, "expert_offset") and hasattr(m, "num_local_experts"):
                for p in m.parameters(recurse=False):
                    self.experts[id(p)] = (m.expert_offset, m.num_experts)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        missing = [i for i, p in enumerate(self.params) if id(p) not in pname]
        if missing:
            raise ValueError(f"optimizer parameters {missing} are not parameters of the model")
        self.param_names = [pname[id(p)] for p in self.params]
        self.save_names = _names_in(self.save_modules, self.state, name_of)
        self.load_names = _names_in(self.load_modules, self.state, name_of)
        saved = set(self.save_names)
        self.save_params = {i for i, n in enumerate(self.param_names) if n in saved}

    # ------------------------------------------------------------------ save
    def _model_entries(self, names: Iterable[str]):
        """``(key, live tensor)`` of model state ``names``, experts one entry each."""
        for n in names:
            t = self.state[n].detach()
            if id(self.state[n]) in self.experts:
                first, _ = self.experts[id(self.state[n])]
                for i in range(t.shape[0]):
                    yield f"{MODEL_PREFIX}{n}.{first + i}", t[i]
            else:
                yield MODEL_PREFIX + n, t

    def _optim_entries(self, index: int, entry: Mapping[str, Any]):
        """``(key, tensor)`` of one parameter's optimizer state entry, experts one each.

        Raises:
            TypeError: a state value that is not a tensor.
        """
        p, name = self.params[index], self.param_names[index]
        expert = self.experts.get(id(p))
        for k, v in entry.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(
                    f"optimizer state {k!r} of {name} is a {type(v).__name__}; a checkpoint "
                    "stores tensors only"
                )
            v = v.detach()
            if expert is not None and v.shape == p.shape:
                for i in range(v.shape[0]):
                    yield f"{OPTIM_PREFIX}{name}.{expert[0] + i}.{k}", v[i]
            else:
                yield f"{OPTIM_PREFIX}{name}.{k}", v

    def save_state(self) -> dict[str, torch.Tensor]:
        """This rank's entries to write: ``{key: tensor}``, views of the live tensors (copy them
        before the next optimizer step changes them); :meth:`param_groups` then gives their
        optimizer groups."""
        self.refresh()
        out = dict(self._model_entries(self.save_names))
        state = self.optimizer.state_dict()["state"]
        for i in sorted(self.save_params):
            if i in state:
                out.update(self._optim_entries(i, state[i]))
        return out

    def param_groups(self) -> dict[str, dict[str, Any]]:
        """``{parameter name: its group's hyper-parameters}`` for the parameters this rank
        writes (JSON-able: tuples become lists; ``params`` / ``param_names`` left out)."""
        groups = self.optimizer.state_dict()["param_groups"]
        out = {}
        for g in groups:
            hyper = {k: _jsonable(v) for k, v in g.items() if k not in ("params", "param_names")}
            for i in g["params"]:
                if i in self.save_params:
                    out[self.param_names[i]] = hyper
        return out

    # ------------------------------------------------------------------ load
    def expected_model_keys(self) -> set[str]:
        """Every model key a checkpoint of the full model holds (every expert of every layer)."""
        keys = set()
        for n, t in self.state.items():
            if id(t) in self.experts:
                keys.update(f"{MODEL_PREFIX}{n}.{e}" for e in range(self.experts[id(t)][1]))
            else:
                keys.add(MODEL_PREFIX + n)
        return keys

    def model_targets(self, stored: Mapping[str, tuple[torch.Size, torch.dtype]]) -> dict:
        """``{key: live tensor}`` to read this rank's model state into, in place (call it first
        when loading: :meth:`optimizer_targets` and :meth:`optimizer_state_dict` follow).

        ``stored``: the checkpoint's ``{key: (shape, dtype)}``.

        Raises:
            LayoutError: a needed key is missing or has another shape, or the checkpoint holds
                model entries the model does not have.
        """
        self.refresh()
        expected = self.expected_model_keys()
        unexpected = sorted(k for k in stored if k.startswith(MODEL_PREFIX) and k not in expected)
        targets = dict(self._model_entries(self.load_names))
        missing = sorted(k for k in targets if k not in stored)
        faults = [f"Missing keys {_few(missing)}"] if missing else []
        if unexpected:
            faults.append(f"unexpected keys {_few(unexpected)}")
        if faults:
            raise LayoutError("; ".join(faults))
        for k, t in targets.items():
            if tuple(stored[k][0]) != tuple(t.shape):
                raise LayoutError(
                    f"{k} has shape {tuple(stored[k][0])} in the checkpoint, "
                    f"{tuple(t.shape)} in this model"
                )
        return targets

    def optimizer_targets(
        self, stored: Mapping[str, tuple[torch.Size, torch.dtype]]
    ) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
        """Buffers (CPU, the stored dtypes) to read this rank's optimizer state into.

        Returns ``(targets, state)``: ``targets`` ``{key: tensor}`` for the reader, ``state``
        ``{parameter index: {state key: tensor}}`` in this optimizer's numbering, whose tensors
        ``targets`` fills (a stacked tensor per expert state). A parameter without a stored
        entry gets none (it never had a gradient).

        Raises:
            LayoutError: an expert state stored for some of this rank's experts only, or one of
                another shape than the parameter's.
        """
        found = _index_optim_keys(stored, set(self.param_names))
        targets: dict[str, torch.Tensor] = {}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, (p, name) in enumerate(zip(self.params, self.param_names, strict=True)):
            entry: dict[str, torch.Tensor] = {}
            for k in found.get((name, None), ()):
                key = f"{OPTIM_PREFIX}{name}.{k}"
                shape, dtype = stored[key]
                entry[k] = targets[key] = torch.empty(shape, dtype=dtype)
            if id(p) in self.experts:
                self._expert_targets(p, name, found, stored, entry, targets)
            if entry:
                state[i] = entry
        return targets, state

    def _expert_targets(self, p, name, found, stored, entry, targets) -> None:
        first, _ = self.experts[id(p)]
        held = range(first, first + p.shape[0])
        keys = {k for e in held for k in found.get((name, e), ())}
        for k in sorted(keys):
            parts = [f"{OPTIM_PREFIX}{name}.{e}.{k}" for e in held]
            absent = [key for key in parts if key not in stored]
            if absent:
                raise LayoutError(f"Missing keys {_few(absent)} (other experts of {name} have {k})")
            shape, dtype = stored[parts[0]]
            if (p.shape[0], *shape) != tuple(p.shape):
                raise LayoutError(
                    f"{parts[0]} has shape {tuple(shape)}; one expert of {name} is "
                    f"{tuple(p.shape[1:])}"
                )
            stacked = entry[k] = torch.empty(p.shape, dtype=dtype)
            for j, key in enumerate(parts):
                targets[key] = stacked[j]

    def optimizer_state_dict(
        self, state: dict[int, dict[str, torch.Tensor]], groups: list[dict], group_of: dict
    ) -> dict[str, Any]:
        """This optimizer's ``state_dict`` from the read ``state`` (:meth:`optimizer_targets`)
        and the stored groups: ``groups`` (hyper-parameters) and ``group_of`` (parameter name
        -> index into ``groups``).

        Raises:
            LayoutError: a parameter without stored hyper-parameters, or one of this
                optimizer's groups whose parameters were stored in different groups.
        """
        out_groups, offset = [], 0
        for gi, g in enumerate(self.optimizer.param_groups):
            names = self.param_names[offset : offset + len(g["params"])]
            absent = [n for n in names if n not in group_of]
            if absent:
                raise LayoutError(f"no stored parameter group for {_few(absent)}")
            stored = {group_of[n] for n in names}
            if len(stored) > 1:
                raise LayoutError(
                    f"the parameters of optimizer group {gi} were stored in groups "
                    f"{sorted(stored)}; this run groups them together"
                )
            hyper = dict(groups[stored.pop()]) if names else {}
            if isinstance(hyper.get("betas"), list):
                hyper["betas"] = tuple(hyper["betas"])
            out_groups.append({**hyper, "params": list(range(offset, offset + len(names)))})
            offset += len(names)
        return {"state": state, "param_groups": out_groups}


def _names_in(modules, state: dict, name_of: dict) -> list[str]:
    """The model state names of ``modules``' state (all of ``state`` for None), in model order."""
    if modules is None:
        return list(state)
    wanted = set()
    for m in modules:
        for k, t in m.state_dict(keep_vars=True).items():
            if id(t) not in name_of:
                raise ValueError(f"{type(m).__name__} entry {k!r} is not part of the model state")
            wanted.add(name_of[id(t)])
    return [n for n in state if n in wanted]


def _index_optim_keys(stored, names: set[str]) -> dict[tuple[str, int | None], list[str]]:
    """``{(parameter name, expert or None): [state keys]}`` of the stored optimizer keys."""
    found: dict[tuple[str, int | None], list[str]] = {}
    for key in stored:
        if not key.startswith(OPTIM_PREFIX):
            continue
        rest = key[len(OPTIM_PREFIX) :]
        m = _EXPERT_KEY.match(rest)
        if m and m.group(1) in names:
            found.setdefault((m.group(1), int(m.group(2))), []).append(m.group(3))
            continue
        m = _PLAIN_KEY.match(rest)
        if m and m.group(1) in names:
            found.setdefault((m.group(1), None), []).append(m.group(2))
    return found


def _jsonable(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _few(keys: list[str], n: int = 5) -> str:
    shown = ", ".join(keys[:n])
    return f"[{shown}{f', ... ({len(keys)} in all)' if len(keys) > n else ''}]"
