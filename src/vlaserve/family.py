"""Policy families: what differs between Pi0.5 and Pi0, in one place.

config.json's `type` picks the family once (`family_named`); everything downstream asks the family
instead of testing the type: the model class, the checkpoint key layout and fp32 set, the prompt
(with or without state bins), the default prompt length, and whether the normalized state goes to
the model (Pi0's state token). The processor steps each family saves are data in
processing/pipeline.py, keyed by the same name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from .checkpoint.weights import PI0_LAYOUT, PI05_LAYOUT, WeightLayout
from .config import PolicyConfig
from .errors import CheckpointError
from .model.pi0 import Pi0Model
from .model.pi05 import Pi05Model
from .processing.prompt import pi0_prompt, pi05_prompt


@dataclass(frozen=True)
class Family:
    name: str  # config.json's type
    display: str
    weights: WeightLayout
    make_model: Callable[[PolicyConfig], nn.Module]
    # (task, normalized state) -> (prompt, state bins or None)
    prompt: Callable[[str, np.ndarray], tuple[str, np.ndarray | None]]
    prompt_end: str  # what a truncated prompt loses, for the warning
    default_max_token_len: int  # LeRobot's tokenizer_max_length default
    state_to_model: bool  # the normalized state, zero-padded to max_state_dim, is a model input

    def build_model(self, config: PolicyConfig) -> nn.Module:
        """The module tree without storage; weights arrive through checkpoint.weights.load_weights."""
        with torch.device("meta"):
            return self.make_model(config)


PI05 = Family("pi05", "Pi0.5", PI05_LAYOUT, lambda c: Pi05Model(c.model), pi05_prompt,
              prompt_end="the state and 'Action:'", default_max_token_len=200, state_to_model=False)
PI0 = Family("pi0", "Pi0", PI0_LAYOUT, lambda c: Pi0Model(c.model, max_state_dim=c.max_state_dim), pi0_prompt,
             prompt_end="the final newline", default_max_token_len=48, state_to_model=True)
FAMILIES = {f.name: f for f in (PI05, PI0)}


def family_named(policy_type, where: str = "config.json") -> Family:
    try:
        return FAMILIES[policy_type]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where} has type {policy_type!r}; vlaserve serves "
                              f"{' and '.join(FAMILIES)}") from None


def family_of(config: PolicyConfig) -> Family:
    return FAMILIES[config.policy_type]
