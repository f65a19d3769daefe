"""Stop strings for the embedded engine: one test, used both to stop generation and to cut its output."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from transformers import StoppingCriteria


def stop_window(stops: Iterable[str]) -> int:
    """Tokens to decode at the tail to see any stop string: a char can take up to 4 byte-level tokens."""
    return 4 * max((len(s) for s in stops), default=0) + 2


def tail_has_stop(tokenizer: Any, tail: list[int], stops: list[str]) -> bool:
    text = tokenizer.decode(tail, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return any(s in text for s in stops)


class StopOnStrings(StoppingCriteria):
    """Stops a row once its recently generated tokens contain a stop string.

    Our own criterion (not generate's `stop_strings`) so that stopping and the post-hoc cut in
    `HFEngine._cut` apply the very same test, on the very same window, and can never disagree.
    """

    def __init__(self, tokenizer: Any, stops: list[str], prompt_width: int) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.prompt_width = prompt_width
        self.window = stop_window(stops)

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        gen = input_ids[:, self.prompt_width :]
        tails = gen[:, -self.window :].tolist()
        done = [tail_has_stop(self.tokenizer, t, self.stops) for t in tails]
        return cast(torch.BoolTensor, torch.tensor(done, dtype=torch.bool, device=input_ids.device))
